"""The vision tower's attention as lathe runs it: one varlen call per layer over every window or image (see
`lathe.models.vl.vision.varlen_attention_class`) equals transformers' per-window SDPA loop."""

import pytest
import torch
import torch.nn.functional as F

from lathe.models.vl import vision

from helpers import assert_close_rel

from .vl_tiny import FAMILIES, hf_model, ragged_vl_batch


def _segment_sdpa(q, k, v, cu, max_len):
    """A reference for `attend_varlen`: SDPA over each segment."""
    bounds = cu.tolist()
    assert max_len == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    return torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)))[0]
                      .transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])


def _grads(tower) -> dict:
    """Gradients by name (Qwen3-VL's deepstack mergers take none from `pooler_output` alone)."""
    return {n: p.grad.float() for n, p in tower.named_parameters() if p.grad is not None}


def _varlen_tower(family):
    tower = hf_model(family).model.visual
    for block in tower.blocks:
        block.attn.__class__ = vision.varlen_attention_class(type(block.attn))
    return tower


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_per_layer_equals_the_per_window_loop(family, monkeypatch):
    """The varlen forward (its attention replaced by per-segment SDPA, since flash varlen needs CUDA) gives
    transformers' output and gradients; each layer makes one call."""
    _, _, pixels, grid, _ = ragged_vl_batch(0)
    ref_tower = hf_model(family).model.visual
    ref = ref_tower(pixels, grid_thw=grid, return_dict=True).pooler_output
    ref.square().sum().backward()
    tower = _varlen_tower(family)
    calls = []
    monkeypatch.setattr(vision, "varlen_ok", lambda x: True)
    monkeypatch.setattr(vision, "attend_varlen", lambda *a: calls.append(a[-1]) or _segment_sdpa(*a))
    out = tower(pixels, grid_thw=grid, return_dict=True).pooler_output
    out.square().sum().backward()
    assert len(calls) == len(tower.blocks)
    assert_close_rel(out, ref, rel=1e-5, name="vision tower output")
    assert_close_rel(_grads(tower), _grads(ref_tower), rel=1e-4, name="vision tower grads")


def test_lathe_builds_its_towers_with_the_varlen_attention():
    from lathe.models.vl import LatheVLForConditionalGeneration, VLConfig

    from .vl_tiny import hf_config
    d = hf_config("qwen2_5_vl").to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    model = LatheVLForConditionalGeneration(VLConfig.from_hf_dict(d))
    assert all(type(b.attn).__name__.startswith("Varlen") for b in model.model.visual.blocks)
    eager = LatheVLForConditionalGeneration(VLConfig.from_hf_dict(d), vision_attn_implementation="eager")
    assert not any(type(b.attn).__name__.startswith("Varlen") for b in eager.model.visual.blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_varlen_on_cuda_equals_the_sdpa_loop(family):
    """bf16 on the GPU: flash varlen against transformers' SDPA loop, forward and gradients."""
    _, _, pixels, grid, _ = ragged_vl_batch(0)
    outs, grads = [], []
    for varlen in (False, True):
        tower = (_varlen_tower(family) if varlen else hf_model(family).model.visual).to("cuda", torch.bfloat16)
        out = tower(pixels.to("cuda", torch.bfloat16), grid_thw=grid.to("cuda"), return_dict=True).pooler_output
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append(_grads(tower))
    assert_close_rel(outs[1], outs[0], rel=2e-2, name="vision tower output")
    assert_close_rel(grads[1], grads[0], rel=5e-2, name="vision tower grads")
