"""lathe's Qwen2.5-VL / Qwen3-VL / Qwen3.5 / GLM-4.1V against transformers: same logits on ragged image+text
batches, packed == padded, the 3D positions of `get_rope_index`, M-RoPE cos/sin, checkpoint names and loading."""

import json

import pytest
import torch

from lathe.models import UnsupportedArchitecture, load_lathe_model
from lathe.models.io import module_names, read_state_dict
from lathe.models.moe import fuse_expert_weights
from lathe.models.vl import (ImageEmbeddings, LatheVLForConditionalGeneration, VLConfig, load_lathe_vl_model,
                             mrope_positions, packed_mrope_positions, rename_legacy_keys)

from helpers import assert_close_rel

from .vl_tiny import FAMILIES, IMAGE, VIDEO, VOCAB, hf_config, ragged_vl_batch, save_hf


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, lathe model loaded from the transformers-saved directory, directory)."""
    path, hf = save_hf(tmp_path_factory.mktemp("vl"), request.param)
    return hf, load_lathe_vl_model(path).eval(), path


@pytest.fixture(scope="module")
def batch():
    return ragged_vl_batch(0)


def _hf_logits(hf, batch):
    ids, mask, pixels, grid, mm_types = batch
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                  mm_token_type_ids=mm_types, use_cache=False).logits


def _pack(ids, mask, positions):
    real = mask.bool()
    seqlens = real.sum(-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return ids[real], positions[:, real], cu, int(seqlens.max())


def test_state_dict_names_equal_the_hf_checkpoint(pair):
    hf, lathe, path = pair
    names = set(lathe.state_dict())
    assert names == module_names(hf.state_dict(), lathe.config)     # (GLM-4.1V's gate_up_proj: gate_proj, up_proj)
    # transformers 5 writes Qwen2.5-VL in the hub's layout (`visual.*`, `model.layers.*`), Qwen3-VL as its modules
    # (Qwen3.5-MoE's experts: one tensor per expert on disk, stacked in the modules, as lathe's text MoE models)
    assert names == module_names(fuse_expert_weights(rename_legacy_keys(read_state_dict(path))), lathe.config)
    assert any(n.startswith("model.visual.") for n in names) and "lm_head.weight" in names
    assert any(n.startswith("model.language_model.layers.1.") for n in names)


def test_rope_index_equals_transformers(pair, batch):
    hf, lathe, _ = pair
    ids, mask, _, grid, mm_types = batch
    for m in (mask, None):
        rows = slice(None) if m is not None else slice(1, 3)          # unmasked: rows whose tokens are all real
        sub_ids, sub_types = ids[rows], mm_types[rows]
        sub_grid = grid if m is not None else grid[:3]
        ref_pos, ref_delta = hf.model.get_rope_index(sub_ids, sub_types, image_grid_thw=sub_grid, attention_mask=m)
        pos, delta = lathe.mrope_positions(sub_ids, sub_grid, m)
        real = m.bool() if m is not None else torch.ones_like(sub_ids, dtype=torch.bool)
        assert torch.equal(pos[:, real], ref_pos[:, real]), "3D positions differ from get_rope_index"
        assert torch.equal(delta, ref_delta), "rope_deltas differ from get_rope_index"
    padded_pos, padded_delta = mrope_positions(ids, grid, mask, image_token_id=IMAGE)
    packed_ids, padded_pos, cu, _ = _pack(ids, mask, padded_pos)
    pos, deltas = packed_mrope_positions(packed_ids, cu, grid, image_token_id=IMAGE)
    assert torch.equal(pos, padded_pos) and torch.equal(deltas, padded_delta.squeeze(1))


def test_mrope_cos_sin_equal_transformers(pair):
    hf, lathe, _ = pair
    positions = torch.randint(0, 200, (3, 2, 11))
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = lathe.model.language_model.rotary_emb(positions, torch.float32)
    if lathe.config.text.rope_interleave:       # GLM-4.1V: transformers' pairs, lathe's halves (`models.glm4`)
        from lathe.models.glm4 import rope_order
        order = rope_order(cos.shape[-1], cos.shape[-1])
        ref_cos, ref_sin = ref_cos[..., order], ref_sin[..., order]
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize("mode", ["mask", "unpad"])
def test_padded_logits_equal_transformers_on_ragged_image_batches(pair, batch, mode):
    hf, lathe, _ = pair
    ids, mask, pixels, grid, _ = batch
    lathe.padded_attention = mode
    ref = _hf_logits(hf, batch)
    with torch.no_grad():
        out = lathe(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
        other = lathe(ids, mask, pixel_values=torch.randn_like(pixels), image_grid_thw=grid).logits
    lathe.padded_attention = "auto"
    real = mask.bool()
    assert out.shape == ref.shape == (*ids.shape, VOCAB)
    assert_close_rel(out[real], ref[real], name=f"logits ({mode})")
    assert torch.isfinite(out).all()
    # the images matter (other pixels, other logits) and only to their own rows
    assert (other[1:3][real[1:3]] - out[1:3][real[1:3]]).abs().max() > 1e-3
    assert_close_rel(other[0][real[0]], out[0][real[0]], rel=1e-6, name="text-only row with other images")


def test_packed_forward_equals_padded_forward(pair, batch):
    _, lathe, _ = pair
    ids, mask, pixels, grid, _ = batch
    positions, _ = lathe.mrope_positions(ids, grid, mask)
    packed_ids, packed_pos, cu, max_len = _pack(ids, mask, positions)
    with torch.no_grad():
        padded = lathe(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
        flat = lathe.forward_packed(packed_ids, packed_pos, cu, max_len, pixels, grid, return_hidden=False)
        hidden = lathe.hidden_packed(packed_ids, packed_pos, cu, max_len, pixels, grid)
    assert hidden.shape == (int(mask.sum()), lathe.config.hidden_size)
    assert_close_rel(flat, padded[mask.bool()], name="packed logits")


def test_precomputed_image_embeddings_equal_pixels(pair, batch):
    """The engine path: encode each image once, split per image, splice back in token order."""
    _, lathe, _ = pair
    ids, mask, pixels, grid, _ = batch
    with torch.no_grad():
        whole = lathe.embed_images(pixels, grid)
        one_by_one = [lathe.embed_images(p, g[None]) for p, g in
                      zip(pixels.split(grid.prod(-1).tolist()), grid)]
        per_image = whole.per_image(grid, lathe.config.spatial_merge_size)
        assert len(per_image) == 3 and len(whole.deepstack) == (2 if lathe.config.family.startswith("qwen3_vl") else 0)
        assert_close_rel(ImageEmbeddings.cat(one_by_one).embeds, whole.embeds, name="per-image encoding")
        ref = lathe(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
        out = lathe(ids, mask, image_grid_thw=grid, image_embeds=ImageEmbeddings.cat(per_image)).logits
    assert torch.equal(out, ref)


def test_gradients_reach_the_vision_tower(pair, batch):
    _, lathe, _ = pair
    ids, mask, pixels, grid, _ = batch
    positions, _ = lathe.mrope_positions(ids, grid, mask)
    packed_ids, packed_pos, cu, max_len = _pack(ids, mask, positions)
    lathe.zero_grad()
    lathe.hidden_packed(packed_ids, packed_pos, cu, max_len, pixels, grid).square().mean().backward()
    grad = lathe.model.visual.patch_embed.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    lathe.zero_grad(set_to_none=True)


def test_tied_checkpoint_loads_with_shared_embeddings(tmp_path, batch):
    from lathe.models import load_lathe_vl_model as load_from_models    # the re-export in lathe.models
    path, hf = save_hf(tmp_path, "qwen3_vl", tie=True)
    lathe = load_from_models(path).eval()
    assert lathe.lm_head.weight is lathe.get_input_embeddings().weight
    ids, mask, pixels, grid, _ = batch
    with torch.no_grad():
        out = lathe(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
    real = mask.bool()
    assert_close_rel(out[real], _hf_logits(hf, batch)[real], name="tied logits")


def test_saved_checkpoint_loads_in_transformers_and_back(pair, batch, tmp_path):
    hf, lathe, _ = pair
    lathe.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    reloaded = type(hf).from_pretrained(tmp_path / "out", attn_implementation="sdpa").eval()
    assert_close_rel(_hf_logits(reloaded, batch), _hf_logits(hf, batch), rel=1e-7, name="transformers reload")
    again = load_lathe_vl_model(tmp_path / "out")
    assert_close_rel(dict(again.state_dict()), dict(lathe.state_dict()), rel=0.0, name="lathe reload")


def test_text_loader_still_refuses_vl_checkpoints(pair):
    """`load_lathe_model` keeps its behaviour: VL checkpoints go to `load_lathe_vl_model` (or transformers)."""
    _, _, path = pair
    with pytest.raises(UnsupportedArchitecture):
        load_lathe_model(path)


def test_unsupported_inputs_and_configs_are_refused(pair, batch):
    _, lathe, path = pair
    ids, mask, pixels, grid, _ = batch
    video_ids = ids.clone()
    video_ids[0, -1] = VIDEO
    with pytest.raises(NotImplementedError, match="video"):
        lathe(video_ids, mask, pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(NotImplementedError, match="video"):
        lathe(ids, mask, pixel_values_videos=pixels, video_grid_thw=grid)
    with pytest.raises(ValueError, match="do not match|placeholder"):
        lathe(ids, mask, pixel_values=pixels[:16], image_grid_thw=grid[:1])
    d = json.loads((path / "config.json").read_text())
    d["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedArchitecture, match="hidden_act"):
        VLConfig.from_hf_dict(d)
    d = json.loads((path / "config.json").read_text())
    d["text_config"]["rope_parameters"].pop("mrope_section")
    with pytest.raises(ValueError, match="mrope_section"):
        VLConfig.from_hf_dict(d)


def test_flat_legacy_qwen2_5_vl_config_and_names():
    """The 4.x layout: text keys at the top level, rope_scaling type 'mrope', `visual.*` / `model.layers.*`."""
    d = hf_config("qwen2_5_vl").to_dict()
    flat = {**d.pop("text_config"), **d}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    flat.pop("rope_parameters", None)
    flat["rope_theta"] = 10000.0
    cfg = VLConfig.from_hf_dict(flat)
    assert cfg.mrope_section == [2, 3, 3] and cfg.text.head_dim == 16 and cfg.text.qkv_bias
    assert cfg.text.rope.rope_type == "default" and cfg.text.rope.rope_theta == 10000.0
    with torch.device("meta"):
        names = set(LatheVLForConditionalGeneration(cfg).state_dict())
    legacy = {n.replace("model.visual.", "visual.").replace("model.language_model.", "model."): None for n in names}
    assert set(rename_legacy_keys(legacy)) == names


def test_bf16_frozen_copy_keeps_the_vision_towers_rope_frequencies(pair):
    """The reference's and rollout's bf16 copy of a VL model (`frozen_copy`) keeps transformers' vision rotary
    frequencies in float32, as the trainer's model and `from_pretrained(dtype=bfloat16)` have them (rounded, every
    patch position's angle would turn by up to p * 2^-9 radians: another model than the trainer's)."""
    from lathe.models.frozen import frozen_copy
    from lathe.models.rope import ROPE_BUFFERS
    _, lathe, _ = pair
    copy = frozen_copy(lathe, torch.bfloat16, torch.device("cpu"))
    freqs = {n: b for n, b in lathe.named_buffers() if n.rpartition(".")[2] in ROPE_BUFFERS}
    assert freqs, "precondition: the vision tower keeps its frequencies in buffers"
    got = dict(copy.named_buffers())
    for name, want in freqs.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
    assert copy.get_input_embeddings().weight.dtype == torch.bfloat16


@pytest.mark.parametrize("family, extra, said", [
    ("qwen3_5", ("mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight"), "block (mtp.*)"),
    ("glm4v_moe", ("model.language_model.layers.2.eh_proj.weight", "model.language_model.layers.2.mlp.gate.weight"),
     "layers of Glm4MoeForCausalLM (model.layers.2 and on)")])
def test_a_checkpoint_s_multi_token_prediction_layers_are_dropped_on_load(tmp_path, batch, caplog, family, extra,
                                                                          said):
    """Qwen3.5's hub checkpoints hold an MTP block (`mtp.*`), GLM-4.5V's may hold GLM-4.5's MTP layer past the
    language model's (`model.language_model.layers.<n>`), which transformers' model ignores too: lathe loads the rest,
    says what it left out, and its saved checkpoint has none of them (transformers' does not either)."""
    import logging
    from safetensors.torch import load_file, save_file
    path, hf = save_hf(tmp_path, family)
    state = load_file(path / "model.safetensors")
    state.update({name: torch.randn(8, 64) for name in extra})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="lathe"):
        lathe = load_lathe_vl_model(path).eval()
    assert any(f"2 tensors of the multi-token-prediction {said}" in r.getMessage() for r in caplog.records)
    ids, mask, pixels, grid, _ = batch
    with torch.no_grad():
        out = lathe(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
    assert_close_rel(out[mask.bool()], _hf_logits(hf, batch)[mask.bool()], name="logits beside an MTP block")
    lathe.save_pretrained(tmp_path / "out")
    assert not set(extra) & set(load_file(tmp_path / "out" / "model.safetensors"))
