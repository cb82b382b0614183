"""GSM8K -> verl parquet, row for row as verl's examples/data_preprocess/gsm8k.py writes it.

Raw rows are {"question", "answer"} with the answer a worked solution ending "#### <number>".
Output rows: prompt = question + " " + INSTRUCTION as one user message; data_source
"openai/gsm8k"; ability "math"; reward_model {"style": "rule", "ground_truth": number with
commas removed}; extra_info {split, index, answer (the full solution), question}.
"""

from __future__ import annotations

import os
import re

from lathe.data.preprocess.common import PreprocessError, read_jsonl, require_str, split_inputs, write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution: str) -> str | None:
    """The number after "#### " in a GSM8K solution, commas removed; None if there is none."""
    match = _FINAL_ANSWER.search(solution)
    return match.group(1).replace(",", "") if match else None


def gsm8k_row(question: str, answer: str, split: str, index: int, ground_truth: str) -> dict:
    """One verl-schema row."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_gsm8k_file(path: str, split: str) -> list[dict]:
    """All rows of one raw GSM8K .jsonl file in verl's schema; index counts rows from 0."""
    rows = []
    for lineno, raw in read_jsonl(path):
        question = require_str(raw, "question", path, lineno)
        answer = require_str(raw, "answer", path, lineno)
        ground_truth = extract_gsm8k_answer(answer)
        if ground_truth is None:
            raise PreprocessError(
                f"{path} line {lineno}: field 'answer' has no final '#### <number>' line "
                f"(ends {answer[-60:]!r}). Fix: end the solution with '#### <number>' or drop the line."
            )
        rows.append(gsm8k_row(question, answer, split, len(rows), ground_truth))
    return rows


def preprocess_gsm8k(input: str, output_dir: str) -> dict[str, str]:
    """Convert raw GSM8K (a folder with train.jsonl/test.jsonl, or one .jsonl) to parquet.

    Writes `<output_dir>/<split>.parquet` for each split found; returns {split: path}.
    """
    out = os.path.expanduser(output_dir)
    written = {}
    for split, path in split_inputs(input, ("train", "test")).items():
        rows = convert_gsm8k_file(path, split)
        written[split] = write_parquet(rows, os.path.join(out, f"{split}.parquet"))
    return written
