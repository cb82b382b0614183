"""MATH-500 -> verl parquet, with the instruction of verl's MATH preprocessing.

Raw rows: {"problem", "solution", "answer", "subject", "level", "unique_id"} (test split only).
Output rows: prompt = problem + " " + INSTRUCTION; data_source "HuggingFaceH4/MATH-500";
ability "math"; ground_truth = the raw `answer` (LaTeX); extra_info {split, index}, as verl's
examples/data_preprocess/math_dataset.py writes them.
"""

from __future__ import annotations

import os

from lathe.data.preprocess.common import read_jsonl, require_str, split_inputs, write_parquet

DATA_SOURCE = "HuggingFaceH4/MATH-500"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def convert_math500_file(path: str, split: str) -> list[dict]:
    """All rows of a raw MATH-500 .jsonl file in verl's schema."""
    rows = []
    for lineno, raw in read_jsonl(path):
        problem = require_str(raw, "problem", path, lineno)
        answer = require_str(raw, "answer", path, lineno)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(rows)},
        })
    return rows


def preprocess_math500(input: str, output_dir: str) -> dict[str, str]:
    """Convert raw MATH-500 (a folder with test.jsonl, or one .jsonl) to `<output_dir>/test.parquet`."""
    out = os.path.expanduser(output_dir)
    written = {}
    for split, path in split_inputs(input, ("test",)).items():
        written[split] = write_parquet(convert_math500_file(path, split), os.path.join(out, f"{split}.parquet"))
    return written
