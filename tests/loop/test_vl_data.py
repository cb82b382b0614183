"""Issue 17, the run's data: a vision-language policy's processor is found from its checkpoint, image rows go
through `load_datasets` with `data.image_key`, and `prompt_batch` carries each row's `multi_modal_inputs`, aligned
with its `prompt_ids` through `repeat`/`select`/`concat`."""

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lathe.batch import Batch
from lathe.config import load_config
from lathe.data.multimodal import IMAGE_TOKEN, tiny_vl_processor
from lathe.loop.setup import load_datasets, load_vl_processor, prompt_batch

SIZES = [(16, 16), (24, 16), (16, 32), (32, 32)]     # every image row gets a grid of its own


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (w * 7 % 255, h * 5 % 255, 90)).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(tmp_path, column: str = "pictures") -> str:
    rows = []
    for i, (w, h) in enumerate(SIZES):
        rows.append({"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": f"<image>Find x{i}."}],
                     column: [{"bytes": png(w, h), "path": None}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}})
    rows.insert(2, {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": "text only"}],
                    column: [], "ability": "math", "reward_model": {"style": "rule", "ground_truth": "0"},
                    "extra_info": {"index": 9}})
    path = str(tmp_path / "mm.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def image_tokens(ids, processor) -> int:
    tid = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    return sum(1 for t in ids if t == tid)


def test_prompt_batch_keeps_images_aligned_with_their_rows(tmp_path):
    processor = tiny_vl_processor()
    cfg = load_config(None, [f"data.train_files={write_rows(tmp_path)}", "data.val_files=null", "trainer.test_freq=-1",
                             "data.image_key=pictures", "data.max_prompt_length=128"])
    train, val = load_datasets(cfg, processor.tokenizer, processor)
    assert val is None and len(train) == 5
    rows = [train[i] for i in range(len(train))]
    batch = prompt_batch(rows, step=0)
    assert "multi_modal_data" in batch and batch["multi_modal_inputs"][2] is None
    merge = int(processor.image_processor.merge_size) ** 2
    grids = [None if m is None else m["image_grid_thw"] for m in batch["multi_modal_inputs"]]
    assert len({tuple(g.flatten().tolist()) for g in grids if g is not None}) == 4, "precondition: distinct grids"

    def check(b: Batch, source_rows: list[int]):
        for j, src in enumerate(source_rows):
            mm = b["multi_modal_inputs"][j]
            assert list(b["prompt_ids"][j]) == rows[src]["prompt_ids"]
            if grids[src] is None:
                assert mm is None and image_tokens(b["prompt_ids"][j], processor) == 0
                continue
            assert torch.equal(mm["image_grid_thw"], grids[src])
            assert image_tokens(b["prompt_ids"][j], processor) == int(mm["image_grid_thw"].prod(-1).sum()) // merge
            assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod(-1).sum())
            assert b["multi_modal_data"][j]["image"][0].size == rows[src]["multi_modal_data"]["image"][0].size

    repeated = batch.repeat(3, interleave=True)
    check(repeated, [i // 3 for i in range(15)])
    order = np.array([14, 0, 7, 6, 3])
    check(repeated.select(order), [i // 3 for i in order])
    check(Batch.concat([repeated.select(order), batch]), [i // 3 for i in order] + list(range(5)))


def test_text_batches_carry_no_multimodal_columns():
    batch = prompt_batch([{"prompt_ids": [1, 2], "raw_prompt": [], "data_source": "d", "ground_truth": "1",
                           "extra_info": {}, "index": 0}], step=0)
    assert "multi_modal_inputs" not in batch and "multi_modal_data" not in batch


def test_image_rows_of_a_text_model_fail_naming_the_column(tmp_path):
    processor = tiny_vl_processor()
    cfg = load_config(None, [f"data.train_files={write_rows(tmp_path)}", "data.val_files=null", "trainer.test_freq=-1",
                             "data.image_key=pictures", "data.max_prompt_length=128"])
    with pytest.raises(ValueError, match="pictures"):
        load_datasets(cfg, processor.tokenizer)          # no processor: a text model


def test_the_processor_is_loaded_for_a_vl_checkpoint_only(tmp_path):
    from models.vl_tiny import save_hf
    assert load_vl_processor(load_config(None, ["actor_rollout_ref.model.path=builtin:tiny"])) == (None, None)
    path, _ = save_hf(tmp_path, "qwen2_5_vl")
    processor = tiny_vl_processor()
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    loaded, why = load_vl_processor(load_config(None, [f"actor_rollout_ref.model.path={path}"]))
    assert loaded is not None and why is None
    assert int(loaded.image_processor.patch_size) == int(processor.image_processor.patch_size)
    assert loaded.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def test_a_vl_checkpoint_without_a_processor_runs_text_rows_and_names_the_cause_at_an_image_row(tmp_path):
    """A released Qwen3.5 checkpoint is vision-language; a run of text data with `tokenizer_path` at a tokenizer
    alone (no preprocessor_config.json) needs no processor (its language model runs alone): it loads, and only an
    image row fails, with the processor loader's error."""
    from models.vl_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5")
    tokenizer_dir = tmp_path / "tok"
    processor = tiny_vl_processor()
    processor.tokenizer.save_pretrained(tokenizer_dir)
    keys = [f"actor_rollout_ref.model.path={path}", f"actor_rollout_ref.model.tokenizer_path={tokenizer_dir}",
            "data.val_files=null", "trainer.test_freq=-1", "data.image_key=pictures", "data.max_prompt_length=128"]
    loaded, why = load_vl_processor(load_config(None, keys))
    assert loaded is None and "preprocessor_config.json" in why and str(tokenizer_dir) in why
    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "d", "prompt": [{"role": "user", "content": "text only"}],
                                          "reward_model": {"ground_truth": "0"}}]), str(text))
    train, _ = load_datasets(load_config(None, [*keys, f"data.train_files={text}"]), processor.tokenizer, loaded, why)
    assert len(train) == 1 and not train.has_images and "multi_modal_inputs" not in train[0]
    with pytest.raises(ValueError, match=r"mm.parquet row 0: field 'pictures'.*could not be loaded.*tok"):
        load_datasets(load_config(None, [*keys, f"data.train_files={write_rows(tmp_path)}"]), processor.tokenizer,
                      loaded, why)
