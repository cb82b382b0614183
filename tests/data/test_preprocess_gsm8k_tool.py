"""Tests for lathe.data.preprocess.gsm8k_tool: GSM8K rows for verl's multi-turn tool recipe (a system message naming
calc_gsm8k_reward, extra_info.tools_kwargs), on synthetic rows and on the first rows of the real data when present."""

import itertools
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lathe.cli import main
from lathe.data.builtin import builtin_tokenizer
from lathe.data.dataset import RLDataset
from lathe.data.preprocess import PREPROCESSORS, PreprocessError
from lathe.data.preprocess.gsm8k import INSTRUCTION, preprocess_gsm8k
from lathe.data.preprocess.gsm8k_tool import SYSTEM_PROMPT, TOOL_NAME, preprocess_gsm8k_tool
from lathe.rollout.agent.builtin_tools import Gsm8kTool
from lathe.rollout.agent.parser import ToolCall
from lathe.rollout.agent.tools import ToolSet

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
FIRST_ROWS = 25

RAW = {"train": [{"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3+1200=1203\n#### 1,203"},
                 {"question": "What is 7 - 9?", "answer": "7-9=-2\n#### -2"}],
       "test": [{"question": "Half of 5?", "answer": "5/2=2.5\n#### 2.5"}]}


def _write_raw(folder: Path, rows_by_split: dict[str, list[dict]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _expected(raw: dict, split: str, index: int, ground_truth: str) -> dict:
    """The row verl's gsm8k_multiturn_w_tool.py writes, less interaction_kwargs (lathe has no interactions)."""
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"],
                           "need_tools_kwargs": True,
                           "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}}}


def tool_reward(tool, row: dict, answer: str) -> float:
    """`tool`'s score of `answer` for a trajectory opened with the row's tools_kwargs, as the agent loop opens it."""
    session = ToolSet([tool]).open("t0", row["extra_info"]["tools_kwargs"])
    try:
        result = session.call(ToolCall(tool.name, {"answer": answer}), timeout_s=30)
        assert not result.error, result.text
        return session.rewards()[tool.name]
    finally:
        session.close()


def _tool_reward(row: dict, answer: str) -> float:
    return tool_reward(Gsm8kTool(), row, answer)


def test_synthetic_rows_have_the_system_prompt_and_tools_kwargs(tmp_path):
    out = PREPROCESSORS["gsm8k_tool"](str(_write_raw(tmp_path / "raw", RAW)), str(tmp_path / "out"))
    assert set(out) == {"train", "test"}
    rows = {split: pq.read_table(path).to_pylist() for split, path in out.items()}
    assert rows["train"] == [_expected(RAW["train"][0], "train", 0, "1203"), _expected(RAW["train"][1], "train", 1, "-2")]
    assert rows["test"] == [_expected(RAW["test"][0], "test", 0, "2.5")]
    assert pq.read_table(out["train"]).column_names == ["data_source", "prompt", "ability", "reward_model",
                                                        "extra_info"]


def test_the_system_prompt_names_the_tool_and_the_answer_format():
    assert TOOL_NAME == "calc_gsm8k_reward" and f"`{TOOL_NAME}`" in SYSTEM_PROMPT and "#### <answer>" in SYSTEM_PROMPT


def test_rows_are_the_plain_gsm8k_rows_plus_the_tool_fields(tmp_path):
    raw = _write_raw(tmp_path / "raw", RAW)
    plain = pq.read_table(preprocess_gsm8k(str(raw), str(tmp_path / "plain"))["train"]).to_pylist()
    tool = pq.read_table(preprocess_gsm8k_tool(str(raw), str(tmp_path / "tool"))["train"]).to_pylist()
    for p, t in zip(plain, tool, strict=True):
        assert t["prompt"][1:] == p["prompt"] and t["reward_model"] == p["reward_model"]
        assert {k: v for k, v in t["extra_info"].items() if k not in ("need_tools_kwargs", "tools_kwargs")} == \
            p["extra_info"]


def test_verls_script_name_is_an_alias_and_the_cli_runs_it(tmp_path, capsys):
    assert PREPROCESSORS["gsm8k_multiturn_w_tool"] is PREPROCESSORS["gsm8k_tool"] is preprocess_gsm8k_tool
    raw = _write_raw(tmp_path / "raw", {"test": RAW["test"]})
    assert main(["preprocess", "gsm8k_tool", "--input", str(raw / "test.jsonl"), "--output", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.strip() == f"test: {tmp_path / 'o' / 'test.parquet'}"
    (row,) = pq.read_table(tmp_path / "o" / "test.parquet").to_pylist()
    assert row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"] == {"ground_truth": "2.5"}


def test_bad_raw_rows_name_file_and_line(tmp_path):
    raw = _write_raw(tmp_path / "raw", {"train": [RAW["train"][0], {"question": "Q", "answer": "no final line"}]})
    with pytest.raises(PreprocessError, match=r"train\.jsonl line 2: field 'answer'.*####"):
        preprocess_gsm8k_tool(str(raw), str(tmp_path / "out"))


def test_the_rows_tools_kwargs_set_up_the_tool_instance(tmp_path):
    out = preprocess_gsm8k_tool(str(_write_raw(tmp_path / "raw", RAW)), str(tmp_path / "out"))
    row = pq.read_table(out["train"]).to_pylist()[0]
    assert _tool_reward(row, "1203") == 1.0
    assert _tool_reward(row, "1204") == 0.0


@pytest.fixture(scope="module")
def real_first_rows(tmp_path_factory):
    """The first FIRST_ROWS rows of each real split, converted (the raw rows too, to compare against)."""
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"no GSM8K copy at {GSM8K}")
    tmp = tmp_path_factory.mktemp("gsm8k_tool")
    raw = {}
    for split in ("train", "test"):
        with open(GSM8K / f"{split}.jsonl", encoding="utf-8") as f:
            raw[split] = [json.loads(line) for line in itertools.islice(f, FIRST_ROWS)]
    out = preprocess_gsm8k_tool(str(_write_raw(tmp / "raw", raw)), str(tmp / "out"))
    return raw, {split: pq.read_table(path).to_pylist() for split, path in out.items()}, out


@pytest.mark.parametrize("split", ["train", "test"])
def test_real_rows_match_verls_layout(real_first_rows, split):
    raw, rows, _ = real_first_rows
    assert len(rows[split]) == FIRST_ROWS
    for i, (r, row) in enumerate(zip(raw[split], rows[split], strict=True)):
        ground_truth = r["answer"].split("####")[-1].strip().replace(",", "")     # an independent parse
        assert row == _expected(r, split, i, ground_truth)
    assert rows["train"][0]["reward_model"]["ground_truth"] == "72"


def test_real_rows_load_into_rl_dataset_and_score_with_the_tool(real_first_rows):
    _, rows, out = real_first_rows
    ds = RLDataset(out["test"], builtin_tokenizer(), max_prompt_length=1024)
    assert len(ds) == FIRST_ROWS and ds.num_filtered == 0
    item = ds[0]
    assert [m["role"] for m in item["raw_prompt"]] == ["system", "user"]
    assert item["extra_info"]["tools_kwargs"] == rows["test"][0]["extra_info"]["tools_kwargs"]
    assert _tool_reward(rows["test"][0], rows["test"][0]["reward_model"]["ground_truth"]) == 1.0
