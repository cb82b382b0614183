"""`lathe preprocess geo3k_tool`: geo3k rows for verl's multi-turn tool recipe (a system message naming
calc_geo3k_reward, extra_info.tools_kwargs), on a synthetic local copy of hiyouga/geometry3k (tiny PNGs)."""

import pyarrow.parquet as pq
import pytest

from lathe.cli import main
from lathe.data.dataset import RLDataset
from lathe.data.multimodal import IMAGE_TOKEN, tiny_vl_processor
from lathe.data.preprocess import PREPROCESSORS, PreprocessError
from lathe.data.preprocess.geo3k import INSTRUCTION, preprocess_geo3k
from lathe.data.preprocess.geo3k_tool import SYSTEM_PROMPT, TOOL_NAME, preprocess_geo3k_tool
from lathe.rollout.agent.builtin_tools import Geo3kTool

from .test_geo3k import RAW, png, raw_copy
from .test_preprocess_gsm8k_tool import tool_reward


def _expected(raw: dict, split: str, index: int) -> dict:
    """The row verl's geo3k_multiturn_w_tool.py writes, less agent_name (lathe's tool loop runs every row)."""
    return {"data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": raw["problem"] + " " + INSTRUCTION}],
            "images": raw["images"],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": raw["answer"]},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["problem"],
                           "need_tools_kwargs": True,
                           "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": raw["answer"]}}}}}


def _tool_reward(row: dict, answer: str) -> float:
    return tool_reward(Geo3kTool(), row, answer)


def test_rows_have_the_images_the_system_prompt_and_tools_kwargs(tmp_path):
    out = PREPROCESSORS["geo3k_tool"](raw_copy(tmp_path / "raw"), str(tmp_path / "out"))
    assert set(out) == {"train", "test"}
    rows = {split: pq.read_table(path).to_pylist() for split, path in out.items()}
    assert rows["train"] == [_expected(RAW["train"][0], "train", 0), _expected(RAW["train"][1], "train", 1)]
    assert rows["test"] == [_expected(RAW["test"][0], "test", 0)]
    assert pq.read_table(out["train"]).column_names == ["data_source", "prompt", "images", "ability", "reward_model",
                                                        "extra_info"]


def test_the_system_prompt_names_the_tool():
    assert TOOL_NAME == "calc_geo3k_reward" and f"`{TOOL_NAME}`" in SYSTEM_PROMPT
    assert "<image>" not in SYSTEM_PROMPT, "the images belong to the user message"


def test_rows_are_the_plain_geo3k_rows_plus_the_tool_fields(tmp_path):
    raw = raw_copy(tmp_path / "raw")
    plain = pq.read_table(preprocess_geo3k(raw, str(tmp_path / "plain"))["train"]).to_pylist()
    tool = pq.read_table(preprocess_geo3k_tool(raw, str(tmp_path / "tool"))["train"]).to_pylist()
    for p, t in zip(plain, tool, strict=True):
        assert t["prompt"][1:] == p["prompt"] and t["images"] == p["images"] and t["reward_model"] == p["reward_model"]
        assert {k: v for k, v in t["extra_info"].items() if k not in ("need_tools_kwargs", "tools_kwargs")} == \
            p["extra_info"]


def test_verls_script_name_is_an_alias_and_the_cli_runs_it(tmp_path, capsys):
    assert PREPROCESSORS["geo3k_multiturn_w_tool"] is PREPROCESSORS["geo3k_tool"] is preprocess_geo3k_tool
    out = tmp_path / "o"
    assert main(["preprocess", "geo3k_multiturn_w_tool", "--input", raw_copy(tmp_path / "raw"),
                 "--output", str(out)]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(["train:", str(out / "train.parquet"),
                                                              "test:", str(out / "test.parquet")])
    (row,) = pq.read_table(out / "test.parquet").to_pylist()
    assert row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"] == {"ground_truth": "\\sqrt{3}"}


def test_bad_raw_rows_name_file_row_and_fix(tmp_path):
    bad = {"train": [{"images": [{"bytes": png(8, 8), "path": None}], "problem": "Find x.", "answer": "3"}]}
    with pytest.raises(PreprocessError, match=r"train-00000-of-00001.parquet row 0: the problem has 0 '<image>'.*Fix"):
        preprocess_geo3k_tool(raw_copy(tmp_path / "a", bad), str(tmp_path / "out"))
    with pytest.raises(PreprocessError, match="no train/test parquet files"):
        preprocess_geo3k_tool(str(tmp_path), str(tmp_path / "out"))


def test_the_rows_load_with_their_images_and_their_tools_kwargs_score_with_the_tool(tmp_path):
    out = preprocess_geo3k_tool(raw_copy(tmp_path / "raw"), str(tmp_path / "out"))
    processor = tiny_vl_processor()
    ds = RLDataset(out["train"], processor.tokenizer, processor=processor, max_prompt_length=1024)
    assert len(ds) == 2 and ds.num_filtered == 0
    item = ds[0]
    assert [m["role"] for m in item["raw_prompt"]] == ["system", "user"]
    grid = item["multi_modal_inputs"]["image_grid_thw"]
    assert item["prompt_ids"].count(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)) == int(grid.prod()) // 4
    row = pq.read_table(out["train"]).to_pylist()[0]
    assert item["extra_info"]["tools_kwargs"] == row["extra_info"]["tools_kwargs"]
    assert _tool_reward(row, "\\boxed{3}") == 1.0 and _tool_reward(row, "3.0") == 1.0
    assert _tool_reward(row, "4") == 0.0
