"""Frozen copies of a model: the reference policy and the rollout engine's weights."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lathe.models.decoder import LatheCausalLM
from lathe.models.io import load_into
from lathe.models.lora import merge_and_unload
from lathe.models.rope import cast_keeping_rope


def frozen_copy(model, dtype: torch.dtype, device: torch.device, *, share: bool = False, state=None):
    """An eval-mode, gradient-free module holding `model`'s weights in `dtype` on `device`.

    lathe's decoder is rebuilt from its state dict tensor by tensor (no second full-precision copy on the way),
    or from `state` ((name, tensor) pairs: a LoRA model's merged weights); with `share`, tensors already in `dtype`
    on `device` are the very same storage (updates show through). A transformers module is deep-copied, its LoRA
    layers merged and an FP8-trained actor's `Float8Linear`s plain `nn.Linear`s (a copy computes in `dtype`); other
    subclasses of `nn.Linear` keep their own forward (DeepSeek-V4's grouped output projection is one)."""
    if not isinstance(model, LatheCausalLM):    # transformers, or a VL model: a copy (its LoRA layers merged)
        out = merge_and_unload(copy.deepcopy(model))
        for m in out.modules():
            if isinstance(m, nn.Linear) and type(m).__name__ == "Float8Linear":     # (torchao's: `train.fp8`)
                m.__class__ = nn.Linear      # the same weight and bias; nn.Linear's forward
        return cast_keeping_rope(out, dtype, device).requires_grad_(False).eval()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: _as(v.detach(), dtype if v.is_floating_point() else v.dtype, device, share)
             for k, v in (state if state is not None else model.state_dict().items())
             if not (tied and k == "lm_head.weight")}
    with torch.device("meta"):
        out = type(model)(model.config)
    load_into(out, state, "the actor's weights", hub=False)
    return out.requires_grad_(False).eval()


def _as(t: torch.Tensor, dtype: torch.dtype, device: torch.device, share: bool) -> torch.Tensor:
    if share and t.dtype == dtype and t.device == torch.device(device):
        return t
    return t.to(device=device, dtype=dtype, copy=True)
