"""The DeepSeek-V3 family (multi-head latent attention, `lathe.models.deepseek`) in lathe's engine.

The paged KV cache holds each token's latent, as absorbed MLA does: the normed latent c (kv_lora_rank values) and the
rotated rope part of k (qk_rope_head_dim), one entry per token and layer shared by every head (`cache_layout`:
one "head" of `MlaConfig.latent_dim`). The layers attend in the absorbed form (`MlaAttention.absorbed`): each head's
query goes through its slice of kv_b_proj's key map before the scores and its output through the value map after,
so the attention runs as multi-query attention over the latent, whose entry is its K and its V alike (one buffer:
`KVCache(latent=True)` makes `v[i]` the tensor `k[i]`). Per layer and token the cache holds latent_dim values where
the decompressed per-head form held 2 x heads x width (Moonlight: 576 against 6144; DeepSeek-V3: 576 against 49152).
The trainer keeps the decompressed form (the same numbers, another order of the products). The FP8 KV cache
(`kv_cache_dtype="fp8"`, `kv_cache`) takes the latent like any other entry. Prefill runs its fresh sequences through
PyTorch's SDPA, not flash attention's varlen kernels, whose head sizes stop at 256.

What the engine leaves off for it (`mla_settings`): CUDA graphs (its decode step has not been checked under a
capture), fused projections (its projections are not q/k/v), FP8 (its projections are not quantised). Tensor-parallel
replicas cut it by heads (`tensor_parallel.ShardLayout`: each rank its heads' rows of q_proj / q_b_proj and kv_b_proj,
o_proj's columns, the low-rank down-projections whole); every rank's cache holds the whole latent, as vLLM's does.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def cache_layout(cfg) -> tuple[int, int]:
    """(heads, width) a token's entry of the KV cache takes per layer for the text config `cfg`: a DeepSeek-V3
    model's latent (one "head" of `MlaConfig.latent_dim`), else its key/value heads of `head_dim`."""
    mla = getattr(cfg, "mla", None)
    return (1, mla.latent_dim) if mla is not None else (cfg.num_key_value_heads, getattr(cfg, "head_dim", None))


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
