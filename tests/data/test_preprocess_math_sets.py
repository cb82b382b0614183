"""lathe.data.preprocess.math_sets on the real MATH-500, AIME 2024 and AMC 2023 copies when present; every
converted row's ground truth is scored right by the math scorer its data_source picks."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lathe.data.preprocess import PREPROCESSORS, PreprocessError

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
MATH500 = DATA / "math500"


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


@pytest.mark.parametrize("name,rows_wanted", [("aime24", 30), ("amc23", 40)])
def test_competition_sets_convert_and_score(tmp_path, name, rows_wanted):
    if not (DATA / name / "test.jsonl").is_file():
        pytest.skip(f"no {name} copy at {DATA / name}")
    from lathe.reward.registry import default_compute_score
    rows = pq.read_table(PREPROCESSORS[name](str(DATA / name), str(tmp_path))["test"]).to_pylist()
    raw = [json.loads(line) for line in (DATA / name / "test.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == len(raw) == rows_wanted
    for row, src in zip(rows, raw):
        truth = row["reward_model"]["ground_truth"]
        assert row["data_source"] == name and float(truth) == float(src["answer"]) and "." not in truth
        assert row["prompt"][0]["content"].startswith(src["problem"])
        assert default_compute_score(name, f"\\boxed{{{truth}}}", truth) == 1.0
