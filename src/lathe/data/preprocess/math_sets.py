"""MATH-500, AIME 2024 and AMC 2023 -> verl parquet, with the instruction of verl's MATH preprocessing.

Raw rows: {"problem", "answer", ...} (test split only; MATH-500 adds "solution", "subject", "level",
"unique_id"; AIME/AMC answers may be JSON numbers). Output rows: prompt = problem + " " + INSTRUCTION;
data_source "HuggingFaceH4/MATH-500", "aime24" or "amc23" (each scored by lathe's math scorer); ability "math";
ground_truth = the raw `answer` (LaTeX; a number written plainly, 27.0 -> "27"); extra_info {split, index}, as
verl's examples/data_preprocess/math_dataset.py writes them.
"""

from __future__ import annotations

import os
from functools import partial

from lathe.data.preprocess.common import read_jsonl, require_str, split_inputs, write_parquet

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DATA_SOURCES = {"math500": "HuggingFaceH4/MATH-500", "aime24": "aime24", "amc23": "amc23"}


def convert_file(path: str, split: str, data_source: str) -> list[dict]:
    """All rows of a raw .jsonl file in verl's schema."""
    rows = []
    for lineno, raw in read_jsonl(path):
        problem = require_str(raw, "problem", path, lineno)
        answer = raw.get("answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = f"{answer:g}"
        answer = require_str({"answer": answer}, "answer", path, lineno)
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(rows)},
        })
    return rows


def preprocess(name: str, input: str, output_dir: str) -> dict[str, str]:
    """Convert raw `name` data (a folder with test.jsonl, or one .jsonl) to `<output_dir>/test.parquet`."""
    out = os.path.expanduser(output_dir)
    return {split: write_parquet(convert_file(path, split, DATA_SOURCES[name]), os.path.join(out, f"{split}.parquet"))
            for split, path in split_inputs(input, ("test",)).items()}


preprocess_math500 = partial(preprocess, "math500")
preprocess_aime24 = partial(preprocess, "aime24")
preprocess_amc23 = partial(preprocess, "amc23")
