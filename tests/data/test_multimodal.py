"""lathe.data.multimodal and RLDataset's image rows: verl's `images` column + `<image>` placeholders -> expanded
prompt ids, pixel_values and image_grid_thw, with a tiny Qwen2-VL style processor built in code."""

import io
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lathe.batch import Batch
from lathe.data.dataset import RLDataset
from lathe.data.errors import DataError
from lathe.data.multimodal import (IMAGE_TOKEN, concat_multi_modal_inputs, encode_multimodal_prompt, image_messages,
                                   load_processor, multimodal_non_tensors, smart_resize, tiny_vl_processor)


@pytest.fixture(scope="module")
def processor():
    return tiny_vl_processor()          # patch 4, merge 2: at most 1024 pixels -> 64 patches -> 16 tokens per image


def png(w: int, h: int, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def row(content: str, images, answer: str = "3") -> dict:
    return {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": content}],
            "images": images, "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": 0}}


def write(tmp_path, rows, name="mm.parquet") -> str:
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def image_token_id(processor) -> int:
    return processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def test_placeholders_become_content_items():
    msgs = image_messages([{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "<image>Find x. <image> ok"}], 2, "f row 0")
    assert msgs[0]["content"] == "be brief"
    assert msgs[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Find x. "}, {"type": "image"},
                                  {"type": "text", "text": " ok"}]


def test_placeholder_count_mismatch_names_row_and_fix():
    with pytest.raises(DataError, match=r"f row 7: the prompt has 1 '<image>' placeholder\(s\) but the row has 2"):
        image_messages([{"role": "user", "content": "<image>Find x."}], 2, "f row 7")


def test_smart_resize_rounds_to_the_factor_within_the_pixel_limits():
    assert smart_resize(21, 13, 8, 64, 1024) == (24, 16)
    h, w = smart_resize(300, 200, 8, 64, 1024)
    assert h % 8 == 0 and w % 8 == 0 and h * w <= 1024 and h > w
    assert smart_resize(2, 2, 8, 256, 1024) == (16, 16)


def test_encode_expands_image_pad_by_grid(processor):
    msgs = [{"role": "user", "content": "<image>Find x. <image>"}]
    enc = encode_multimodal_prompt(msgs, [{"bytes": png(20, 13), "path": None}, png(64, 64)], processor, "f row 0")
    grid = enc.multi_modal_inputs["image_grid_thw"]
    assert grid.dtype == torch.long and grid.shape == (2, 3)
    per_image = (grid.prod(-1) // 4).tolist()
    assert enc.prompt_ids.count(image_token_id(processor)) == sum(per_image)
    pv = enc.multi_modal_inputs["pixel_values"]
    assert pv.shape == (int(grid.prod(-1).sum()), 3 * 2 * 4 * 4) and pv.dtype == torch.float32
    text = processor.tokenizer.decode(enc.prompt_ids)
    first = "<|vision_start|>" + IMAGE_TOKEN * per_image[0] + "<|vision_end|>Find x. "
    assert text.startswith("<|im_start|>user\n" + first) and text.endswith("<|im_start|>assistant\n")
    assert [im.mode for im in enc.images] == ["RGB", "RGB"]


def test_images_as_paths_bytes_and_bad_input(tmp_path, processor):
    (tmp_path / "a.png").write_bytes(png(16, 16))
    msgs = [{"role": "user", "content": "<image>"}]
    for image in ("a.png", str(tmp_path / "a.png"), png(16, 16), {"bytes": None, "path": "a.png"}):
        enc = encode_multimodal_prompt(msgs, [image], processor, "f row 0", base_dir=str(tmp_path))
        assert enc.multi_modal_inputs["image_grid_thw"].shape == (1, 3)
    with pytest.raises(DataError, match=r"f row 3, images\[0\]: image file not found: 'nope.png'.*Fix"):
        encode_multimodal_prompt(msgs, ["nope.png"], processor, "f row 3", base_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"f row 4, images\[0\]: image does not decode.*Fix"):
        encode_multimodal_prompt(msgs, [{"bytes": b"not a png", "path": None}], processor, "f row 4")


def test_dataset_items_carry_multimodal_fields(tmp_path, processor):
    text_row = {**row("What is 1+2?", None)}
    path = write(tmp_path, [row("<image>Find x.", [{"bytes": png(30, 20), "path": None}]), text_row])
    ds = RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=200)
    item, text_item = ds[0], ds[1]
    grid = item["multi_modal_inputs"]["image_grid_thw"]
    assert item["prompt_ids"].count(image_token_id(processor)) == int(grid.prod()) // 4
    assert item["multi_modal_inputs"]["pixel_values"].shape[0] == int(grid.prod())
    assert len(item["multi_modal_data"]["image"]) == 1
    assert not any(k.startswith("_") for k in item)
    assert text_item["multi_modal_inputs"] is None and text_item["multi_modal_data"] is None   # columns in every batch
    text_only = RLDataset(write(tmp_path, [text_row], "t.parquet"), processor.tokenizer, max_prompt_length=200)
    assert "multi_modal_inputs" not in text_only[0]                 # a text run's items are as before
    assert item["raw_prompt"] == [{"role": "user", "content": "<image>Find x."}]


def test_prompt_length_counts_expanded_image_tokens(tmp_path, processor):
    path = write(tmp_path, [row("<image>Find x.", [png(64, 64)]), row("<image>y", [png(8, 8)])])
    full = RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=500)
    n0, n1 = (len(full[i]["prompt_ids"]) for i in range(2))
    assert n0 > n1 > 0
    ds = RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=n0 - 1,
                   filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1
    with pytest.raises(DataError, match="mm.parquet row 0: prompt is .* tokens"):
        RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=n0 - 1)
    with pytest.raises(DataError, match="truncation would cut image tokens"):
        RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=8, truncation="right")
    cut = RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=n0 - 2, truncation="left")
    assert len(cut[0]["prompt_ids"]) == n0 - 2 and cut.num_truncated == 1    # only text cut, all image tokens kept


def test_dataset_errors_name_file_row_and_fix(tmp_path, processor):
    bad_count = write(tmp_path, [row("Find x.", [png(8, 8)])], "count.parquet")
    with pytest.raises(DataError, match=r"count.parquet row 0: the prompt has 0 '<image>'.*Fix"):
        RLDataset(bad_count, processor.tokenizer, processor=processor)
    missing = write(tmp_path, [row("<image>x", ["missing.png"])], "missing.parquet")
    with pytest.raises(DataError, match=r"missing.parquet row 0, images\[0\]: image file not found"):
        RLDataset(missing, processor.tokenizer, processor=processor)
    images = write(tmp_path, [row("<image>x", [png(8, 8)])], "img.parquet")
    with pytest.raises(DataError, match=r"img.parquet row 0: field 'images': .*no vision processor.*Fix"):
        RLDataset(images, processor.tokenizer)


def test_batch_carries_per_sample_multimodal_objects(tmp_path, processor):
    path = write(tmp_path, [row("<image>a", [png(64, 64)]), row("<image>b<image>", [png(8, 8), png(16, 40)])])
    ds = RLDataset(path, processor.tokenizer, processor=processor, max_prompt_length=500)
    rows = [ds[0], ds[1]]
    batch = Batch(non_tensors={"prompt_ids": [r["prompt_ids"] for r in rows], **multimodal_non_tensors(rows)})
    picked = batch.repeat(2).select([3, 0])
    assert picked["multi_modal_inputs"][0]["image_grid_thw"].shape == (2, 3)
    joined = concat_multi_modal_inputs(list(picked["multi_modal_inputs"]))
    grids = joined["image_grid_thw"]
    assert grids.shape == (3, 3) and joined["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    assert multimodal_non_tensors([{"prompt_ids": [1]}]) == {}


def test_load_processor_round_trips_a_saved_processor(tmp_path, processor):
    processor.tokenizer.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    loaded = load_processor(str(tmp_path))
    msgs = [{"role": "user", "content": "<image>x"}]
    a = encode_multimodal_prompt(msgs, [png(30, 30)], processor, "o")
    b = encode_multimodal_prompt(msgs, [png(30, 30)], loaded, "o")
    assert a.prompt_ids == b.prompt_ids
    assert torch.equal(a.multi_modal_inputs["pixel_values"], b.multi_modal_inputs["pixel_values"])


def _saved(tmp_path, processor, *, image_processor=True):
    processor.tokenizer.save_pretrained(tmp_path)
    if image_processor:
        processor.image_processor.save_pretrained(tmp_path)
    return str(tmp_path)


def _auto_processor_raises(monkeypatch, error):
    import transformers

    def from_pretrained(*args, **kwargs):
        raise error
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", from_pretrained)


def test_a_processor_that_fails_to_load_is_an_error_naming_the_directory_and_the_cause(tmp_path, processor,
                                                                                        monkeypatch):
    path = _saved(tmp_path, processor)          # tokenizer and image processor load fine: no quiet substitute
    _auto_processor_raises(monkeypatch, ValueError("needs trust_remote_code=True"))
    with pytest.raises(DataError, match=rf"{re.escape(path)}: the processor could not be loaded: ValueError: needs "
                                        r"trust_remote_code=True\. Fix:") as err:
        load_processor(path)
    assert isinstance(err.value.__cause__, ValueError)


def test_a_corrupt_processor_file_is_an_error_naming_the_directory(tmp_path, processor):
    path = _saved(tmp_path, processor)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(DataError, match=rf"{re.escape(path)}: the processor could not be loaded: .*preprocessor_config.json"):
        load_processor(path)


def test_a_directory_without_an_image_processor_is_not_a_vision_language_checkpoint(tmp_path, processor):
    path = _saved(tmp_path, processor, image_processor=False)
    with pytest.raises(DataError, match=rf"{re.escape(path)}: no image processor .* not a vision-language checkpoint"):
        load_processor(path)


def test_a_processor_class_needing_a_missing_library_is_replaced_with_a_warning(tmp_path, processor, monkeypatch):
    path = _saved(tmp_path, processor)
    _auto_processor_raises(monkeypatch, ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it "
                                                    "was not found in your environment.\nSee the installation page."))
    with pytest.warns(UserWarning, match=rf"{re.escape(path)}: transformers' processor cannot be built here "
                                         r"\(Qwen2VLVideoProcessor requires the Torchvision library"):
        loaded = load_processor(path)
    msgs = [{"role": "user", "content": "<image>x"}]
    a = encode_multimodal_prompt(msgs, [png(30, 30)], processor, "o")
    assert encode_multimodal_prompt(msgs, [png(30, 30)], loaded, "o").prompt_ids == a.prompt_ids


def test_a_tokenizer_and_image_processor_without_a_processor_config_load_without_a_warning(tmp_path, processor):
    import warnings
    path = _saved(tmp_path, processor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_processor(path).image_processor is not None


def test_a_glm_checkpoint_s_image_token_is_read_from_its_config_when_its_processor_cannot_be_built(tmp_path,
                                                                                                  monkeypatch):
    """GLM-4.1V's placeholder is `<|image|>` (config.json's image_token_id), not Qwen-VL's `<|image_pad|>`: lathe's
    own processor (transformers' needs torchvision for its video part) expands that one by each image's grid."""
    import json
    glm = tiny_vl_processor()
    tok = glm.tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>"]})
    tok.chat_template = ("{%- for m in messages %}{%- for c in m['content'] %}{%- if c['type'] == 'image' %}"
                         "{{- '<|begin_of_image|><|image|><|end_of_image|>' }}{%- else %}{{- c['text'] }}{%- endif %}"
                         "{%- endfor %}{%- endfor %}")
    path = _saved(tmp_path, glm)
    image = tok.convert_tokens_to_ids("<|image|>")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Glm4vForConditionalGeneration"],
                                                      "image_token_id": image}))
    _auto_processor_raises(monkeypatch, ImportError("Glm4vVideoProcessor requires the Torchvision library"))
    with pytest.warns(UserWarning, match="cannot be built here"):
        loaded = load_processor(path)
    assert loaded.image_token == "<|image|>"
    out = encode_multimodal_prompt([{"role": "user", "content": "<image>x"}], [png(30, 30)], loaded, "o")
    grid = out.multi_modal_inputs["image_grid_thw"][0]
    assert out.prompt_ids.count(image) == int(grid.prod()) // 4 > 1
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) not in out.prompt_ids
