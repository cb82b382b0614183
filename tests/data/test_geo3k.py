"""`lathe preprocess geo3k`: a local copy of hiyouga/geometry3k (HF datasets' parquet layout) -> verl rows with
images, which RLDataset encodes with a VL processor and lathe.reward scores. The copy is synthetic (tiny PNGs)."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lathe.cli import main
from lathe.data.dataset import RLDataset
from lathe.data.multimodal import IMAGE_TOKEN, tiny_vl_processor
from lathe.data.preprocess import PREPROCESSORS, PreprocessError
from lathe.data.preprocess.geo3k import INSTRUCTION, preprocess_geo3k
from lathe.reward import default_compute_score


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 120, 240)).save(buf, format="PNG")
    return buf.getvalue()


RAW = {
    "train": [{"images": [{"bytes": png(24, 16), "path": "0.png"}], "problem": "<image>Find x.", "answer": "3"},
              {"images": [{"bytes": png(12, 12), "path": None}], "problem": "<image>Find the area.", "answer": "24"}],
    "test": [{"images": [{"bytes": png(20, 20), "path": "t.png"}], "problem": "<image>Find y.", "answer": "\\sqrt{3}"}],
}


def raw_copy(root, raw=RAW):
    """The folder layout of a downloaded HF dataset: data/<split>-00000-of-00001.parquet."""
    (root / "data").mkdir(parents=True)
    for split, rows in raw.items():
        pq.write_table(pa.Table.from_pylist(rows), str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return str(root)


def test_rows_follow_verls_geo3k_script(tmp_path):
    out = preprocess_geo3k(raw_copy(tmp_path / "raw"), str(tmp_path / "out"))
    assert set(out) == {"train", "test"}
    rows = pq.read_table(out["train"]).to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]
    first = rows[0]
    assert first["data_source"] == "hiyouga/geometry3k" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": "<image>Find x. " + INSTRUCTION}]
    assert "<think> </think>" in INSTRUCTION and "\\boxed{}" in INSTRUCTION
    assert first["reward_model"] == {"style": "rule", "ground_truth": "3"}
    assert first["extra_info"] == {"split": "train", "index": 0, "answer": "3", "question": "<image>Find x."}
    assert first["images"][0]["bytes"] == RAW["train"][0]["images"][0]["bytes"]
    test_rows = pq.read_table(out["test"]).to_pylist()
    assert test_rows[0]["extra_info"]["split"] == "test"


def test_command_writes_files_the_dataset_and_reward_use(tmp_path, capsys):
    assert "geo3k" in PREPROCESSORS
    out = tmp_path / "out"
    assert main(["preprocess", "geo3k", "--input", raw_copy(tmp_path / "raw"), "--output", str(out)]) == 0
    assert "train:" in capsys.readouterr().out
    processor = tiny_vl_processor()
    ds = RLDataset(str(out / "train.parquet"), processor.tokenizer, processor=processor, max_prompt_length=1024)
    item = ds[0]
    grid = item["multi_modal_inputs"]["image_grid_thw"]
    assert item["prompt_ids"].count(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)) == int(grid.prod()) // 4
    response = "<think>x is 3</think> \\boxed{3}"
    assert default_compute_score(item["data_source"], response, item["ground_truth"]) == pytest.approx(1.0)


def test_bad_raw_rows_name_file_row_and_fix(tmp_path):
    bad = {"train": [{"images": [{"bytes": png(8, 8), "path": None}], "problem": "Find x.", "answer": "3"}]}
    with pytest.raises(PreprocessError, match=r"train-00000-of-00001.parquet row 0: the problem has 0 '<image>'.*Fix"):
        preprocess_geo3k(raw_copy(tmp_path / "a", bad), str(tmp_path / "out"))
    bad = {"train": [{"images": [{"bytes": png(8, 8), "path": None}], "problem": "<image>x", "answer": ""}]}
    with pytest.raises(PreprocessError, match=r"row 0: field 'answer' must be a non-empty string"):
        preprocess_geo3k(raw_copy(tmp_path / "b", bad), str(tmp_path / "out"))
    with pytest.raises(PreprocessError, match="no train/test parquet files"):
        preprocess_geo3k(str(tmp_path), str(tmp_path / "out"))
