"""The DeepSeek-V3 family (multi-head latent attention, `lathe.models.deepseek`) in lathe's engine.

The latent attention hands the engine's step attentions per-head q, k and v like any multi-head attention (k's rope
part rotated by the layer itself, v zero-padded to k's width), so the paged KV cache holds each head's decompressed K
and padded V: `num_key_value_heads` = the query heads, `head_dim` = max(qk_nope + qk_rope, v) (`MlaConfig.attn_dim`).
Not done: the compressed-latent cache of absorbed MLA (kv_lora_rank + qk_rope_head_dim values per token and layer,
queries absorbed through kv_b_proj), which takes far less memory per token: per layer and token the decompressed
cache holds 2 * heads * width values, the latent one kv_lora_rank + qk_rope_head_dim (Moonlight: 16 heads of width
192, 6144 against 576; DeepSeek-V3: 128 heads, 49152 against 576). So the engine's cache suits the family's small
members; the large ones need the latent cache first. The FP8 KV cache (`kv_cache_dtype="fp8"`, `kv_cache`) takes the
decompressed K/V like any other (V's zero padding quantises to zeros with a finite scale).

What the engine leaves off for it (`mla_settings`): CUDA graphs (its decode step has not been checked under a
capture), fused projections (its projections are not q/k/v), FP8 (its projections are not quantised). Tensor-parallel
replicas cut it by heads (`tensor_parallel.ShardLayout`: each rank its heads' rows of q_proj / q_b_proj and kv_b_proj,
o_proj's columns, the low-rank down-projections whole), so each rank's cache holds its heads' K and V.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def is_mla(model) -> bool:
    """Whether `model` runs DeepSeek-V3's latent attention."""
    return getattr(getattr(model, "config", None), "mla", None) is not None


def mla_settings(model, enforce_eager: bool, fuse_projections: bool | None, quantization: str | None
                 ) -> tuple[bool, bool]:
    """(enforce_eager, fuse_projections) for a DeepSeek-V3 model: both off, with a notice where CUDA graphs were
    asked for; FP8 and fused projections asked for are refused (module doc)."""
    arch = model.config.architecture
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} (rollout.quantization): lathe's FP8 engine layers are not "
                         f"built for {arch}'s latent attention yet. Fix: leave rollout.quantization unset")
    if fuse_projections:
        raise ValueError(f"fuse_projections=True: not implemented for {arch}'s latent attention (its projections "
                         "are not q/k/v). Fix: leave it unset")
    if not enforce_eager and model.device.type == "cuda":
        log.info("engine: %s decodes without CUDA graphs (its latent-attention decode step is not checked under a "
                 "capture yet): slower than the dense families' rollout", arch)
    return True, False
