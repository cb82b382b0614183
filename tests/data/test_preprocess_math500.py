"""Tests for lathe.data.preprocess.math500 on the real MATH-500 copy when present."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lathe.data.preprocess import PREPROCESSORS, PreprocessError

MATH500 = Path(__file__).resolve().parents[3] / "shared" / "data" / "math500"


def test_math500_rows(tmp_path):
    if not (MATH500 / "test.jsonl").is_file():
        pytest.skip(f"no MATH-500 copy at {MATH500}")
    out = PREPROCESSORS["math500"](str(MATH500), str(tmp_path))
    rows = pq.read_table(out["test"]).to_pylist()
    raw = [json.loads(line) for line in (MATH500 / "test.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == len(raw) == 500
    for i, (row, src) in enumerate(zip(rows, raw)):
        assert row["data_source"] == "HuggingFaceH4/MATH-500" and row["ability"] == "math"
        assert row["reward_model"] == {"style": "rule", "ground_truth": src["answer"]}
        assert row["prompt"] == [{"role": "user", "content": src["problem"]
                                  + " Let's think step by step and output the final answer within \\boxed{}."}]
        assert row["extra_info"] == {"split": "test", "index": i}


def test_math500_bad_row(tmp_path):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps({"problem": "1+1?", "answer": ""}) + "\n")
    with pytest.raises(PreprocessError, match=r"test\.jsonl line 1: field 'answer'"):
        PREPROCESSORS["math500"](str(src), str(tmp_path / "out"))
