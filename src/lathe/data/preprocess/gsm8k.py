"""GSM8K -> verl parquet, row for row as verl's examples/data_preprocess/gsm8k.py writes it.

Raw rows are {"question", "answer"} with the answer a worked solution ending "#### <number>".
Output rows: prompt = question + " " + INSTRUCTION as one user message; data_source
"openai/gsm8k"; ability "math"; reward_model {"style": "rule", "ground_truth": number with
commas removed}; extra_info {split, index, answer (the full solution), question}.
`row_fn` builds another row layout from the same parsed fields (gsm8k_tool.py: the multi-turn tool variant).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from lathe.data.preprocess.common import PreprocessError, read_jsonl, require_str, split_inputs, write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

# (question, answer, split, index, ground_truth) -> one verl-schema row
RowFn = Callable[[str, str, str, int, str], dict]


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


def convert_gsm8k_file(path: str, split: str, row_fn: RowFn = gsm8k_row) -> list[dict]:
    """All rows of one raw GSM8K .jsonl file in verl's schema (built by `row_fn`); index counts rows from 0."""
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
        rows.append(row_fn(question, answer, split, len(rows), ground_truth))
    return rows


def preprocess_gsm8k(input: str, output_dir: str, row_fn: RowFn = gsm8k_row) -> dict[str, str]:
    """Convert raw GSM8K (a folder with train.jsonl/test.jsonl, or one .jsonl) to parquet.

    Writes `<output_dir>/<split>.parquet` for each split found; returns {split: path}.
    """
    out = os.path.expanduser(output_dir)
    written = {}
    for split, path in split_inputs(input, ("train", "test")).items():
        rows = convert_gsm8k_file(path, split, row_fn)
        written[split] = write_parquet(rows, os.path.join(out, f"{split}.parquet"))
    return written
