"""Tests for lathe.data.preprocess.gsm8k: verl's GSM8K parquet, on the real data when present."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lathe.data.builtin import builtin_tokenizer
from lathe.data.dataset import RLDataset
from lathe.data.preprocess import PREPROCESSORS, PreprocessError
from lathe.data.preprocess.gsm8k import INSTRUCTION, extract_gsm8k_answer, preprocess_gsm8k

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason=f"no GSM8K copy at {GSM8K}")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"no GSM8K copy at {GSM8K}")
    return PREPROCESSORS["gsm8k"](str(GSM8K), str(tmp_path_factory.mktemp("gsm8k")))


def _raw(split):
    return [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines() if line.strip()]


@needs_gsm8k
def test_row_counts_and_columns(converted):
    assert set(converted) == {"train", "test"}
    for split, n in (("train", 7473), ("test", 1319)):
        table = pq.read_table(converted[split])
        assert table.num_rows == n
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@needs_gsm8k
@pytest.mark.parametrize("split", ["train", "test"])
def test_rows_match_verl_schema(converted, split):
    rows = pq.read_table(converted[split]).to_pylist()
    raw = _raw(split)
    for i in (0, 1, len(rows) - 1):
        row = rows[i]
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": raw[i]["question"] + " " + INSTRUCTION}]
        assert row["extra_info"] == {"split": split, "index": i, "answer": raw[i]["answer"],
                                     "question": raw[i]["question"]}
        assert row["reward_model"]["style"] == "rule"


@needs_gsm8k
def test_ground_truth_is_number_after_hashes(converted):
    rows = pq.read_table(converted["train"]).to_pylist()
    first = rows[0]
    after = first["extra_info"]["answer"].split("####")[-1].strip()
    assert first["reward_model"]["ground_truth"] == after == "72"
    # every row, against an independent parse of the raw solution
    for row, raw in zip(rows, _raw("train")):
        assert row["reward_model"]["ground_truth"] == raw["answer"].split("####")[-1].strip().replace(",", "")


@needs_gsm8k
def test_instruction_text_is_verls(converted):
    row = pq.read_table(converted["test"]).slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["content"].endswith(
        ' Let\'s think step by step and output the final answer after "####".')


@needs_gsm8k
def test_output_loads_into_rl_dataset(converted):
    ds = RLDataset(converted["test"], builtin_tokenizer(), max_prompt_length=256, filter_overlong_prompts=True)
    assert len(ds) + ds.num_filtered == 1319 and len(ds) > 0
    assert ds[0]["data_source"] == "openai/gsm8k"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_extract_answer_removes_commas_keeps_sign():
    assert extract_gsm8k_answer("so\n#### 1,234") == "1234"
    assert extract_gsm8k_answer("#### -5") == "-5"
    assert extract_gsm8k_answer("#### 2.50") == "2.50"
    assert extract_gsm8k_answer("the answer is 5") is None


def test_single_file_input_gives_its_split(tmp_path):
    src = _write(tmp_path / "my_test.jsonl", [{"question": "Q?", "answer": "work\n#### 3,000"}])
    out = preprocess_gsm8k(str(src), str(tmp_path / "out"))
    assert set(out) == {"test"}
    (row,) = pq.read_table(out["test"]).to_pylist()
    assert row["reward_model"]["ground_truth"] == "3000"
    assert row["extra_info"]["split"] == "test" and row["extra_info"]["index"] == 0


def test_missing_final_answer_names_file_and_line(tmp_path):
    _write(tmp_path / "train.jsonl", [{"question": "Q", "answer": "#### 1"}, {"question": "Q", "answer": "no"}])
    with pytest.raises(PreprocessError, match=r"train\.jsonl line 2: field 'answer'.*####"):
        preprocess_gsm8k(str(tmp_path), str(tmp_path / "out"))


def test_missing_question_names_file_and_line(tmp_path):
    src = _write(tmp_path / "train.jsonl", [{"answer": "#### 1"}])
    with pytest.raises(PreprocessError, match=r"train\.jsonl line 1: field 'question'"):
        preprocess_gsm8k(str(src), str(tmp_path / "out"))


def test_missing_input(tmp_path):
    with pytest.raises(PreprocessError, match="input not found"):
        preprocess_gsm8k(str(tmp_path / "absent"), str(tmp_path / "out"))
    with pytest.raises(PreprocessError, match=r"no train\.jsonl, test\.jsonl inside"):
        preprocess_gsm8k(str(tmp_path), str(tmp_path / "out"))
