"""The attention callables of the engine's steps (`lathe.models.attention.AttentionFn`): each is bound to one step's
layout over the paged KV cache, called once per layer, in order, and counts the layers to know which cache to write
and read. Besides attending, each tells the engine's forward (`decode_forms.text_hidden`) how the step runs the
decoder: `split_k` (the layers' split form, or None: their plain forward) and `rope` (the step's RoPE rows, or
None: computed from the positions).

Both take a layer's `sinks` and sliding `window` (GPT-OSS, `lathe.models.attention`): the new K/V are stored as
always, and the attention over the cache applies them (`paged_attention`, `triton_decode`).

An FP8 cache's scales (`KVCache.layer_scales`) go with its K/V to every store and read. A prefill's fresh sequences
attend over their own K/V as the projections gave them (`fresh`, no cache read), as before; the quantised copies
serve the later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lathe.engine import triton_store
from lathe.engine.kv_cache import KVCache
from lathe.engine.paged_attention import CachedPrefill, decode_with
from lathe.models.attention import PackedAttention
from lathe.models.rope import apply_rotary


@dataclass
class DecodeAttention:
    """One token per sequence: store its K/V at `slot_mapping`, attend over the blocks. No host syncs, so it
    can run under CUDA-graph capture."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor      # (B,) int64, every slot valid (padding rows write the scratch slot)
    block_tables: torch.Tensor      # (B, max_blocks) int32
    context_lens: torch.Tensor      # (B,) int32
    backend: str = "torch"
    num_splits: int = 1
    # whether the layers hand this attention q and k before RoPE, with cos/sin (`AttentionFn`); on CUDA by default:
    # one Triton launch then rotates q and k and stores k and v (`triton_store.rope_store_kv`); with the Triton decode
    # kernel that launch is the attention's own (`triton_decode.paged_decode(new_kv=...)`)
    rotates: bool | None = None
    # (o_proj, down_proj) K splits of the engine's split-K layers (`decode_forms.split_layer`), or None: the
    # layers' plain forward (`decode_forms.step_split_k` picks them)
    split_k: tuple[int, int] | None = None
    # the step's RoPE rows (cos, sin), each (B, head_dim), when the caller has them (the decode graph's table lookup,
    # `triton_step.step_inputs`); None: computed from the positions (`decode_forms.text_hidden`)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # launch the Triton kernel as a programmatic dependent of the q/k/v projection before it (`paged_decode(pdl=True)`):
    # only where the context lengths, slots and RoPE rows were written at the step's start (`step_inputs`), not by
    # the launch right before the attention
    pdl: bool = False
    # groups of rows sharing a prompt's blocks, attended over it once per group (`triton_decode.paged_decode`'s
    # `prefix`; the decode graphs set it: `cuda_graph.DecodeGraphs`), or None
    prefix: object | None = None
    layer_options: ClassVar[bool] = True       # takes `sinks` and `window` (`AttentionFn`)

    def __post_init__(self):
        if self.rotates is None:
            self.rotates = self.kv_cache.device.type == "cuda" and triton_store.triton is not None
        self.layer = 0
        self.counters = None        # the split kernel's merge counters, one zeroed set shared by the step's layers
        if self.backend == "triton" and self.num_splits > 1:
            rows, kv_heads = self.block_tables.shape[0], self.kv_cache.k[0].shape[2]
            self.counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device=self.block_tables.device)

    @property
    def latent(self) -> bool:
        """Whether the cache holds DeepSeek-V3's latent (the layers then attend in the absorbed form: `mla.py`)."""
        return self.kv_cache.latent

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None, *, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        layer = self.layer
        self.layer += 1
        scales = self.kv_cache.layer_scales(layer)
        in_launch = cos is not None and triton_store.can_rope_store(q, k, v, cos, sin)
        if in_launch and self.backend == "triton":
            from lathe.engine.triton_decode import paged_decode      # RoPE, store and attention in one launch
            return paged_decode(q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.block_tables,
                                self.context_lens, num_splits=self.num_splits, counters=self.counters,
                                new_kv=(k, v, cos, sin, self.slot_mapping), pdl=self.pdl, sinks=sinks, window=window,
                                scales=scales, prefix=self.prefix)
        if in_launch:
            q = triton_store.rope_store_kv(q, k, v, cos, sin, self.kv_cache.k[layer], self.kv_cache.v[layer],
                                           self.slot_mapping, scales)
        else:
            if cos is not None:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            self.kv_cache.store_unchecked(layer, k, v, self.slot_mapping)
        return decode_with(self.backend, q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.block_tables,
                           self.context_lens, self.num_splits, self.counters, sinks=sinks, window=window,
                           scales=scales, prefix=self.prefix)


@dataclass
class PrefillAttention:
    """New tokens laid out as [fresh sequences | single new tokens | the rest] (see `model_runner`'s docstring)."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor      # slots of the new tokens whose KV is not cached yet (rows `store_rows`)
    num_fresh_tokens: int
    fresh: PackedAttention | None
    single: tuple[torch.Tensor, torch.Tensor] | None     # (block_tables, context_lens) of the single-token group
    rest: tuple[list[int], list[int], list[list[int]]]   # (cu_seqlens_q from the group's start, ctx lens, tables)
    decode_backend: str = "torch"
    store_rows: torch.Tensor | None = None     # rows of the new tokens to store (None: all of them)
    split_k: tuple[int, int] | None = None     # the layers' split form (`step_split_k`), or None: their plain forward
    cached_backend: str = "sdpa"               # the rest's `CachedPrefill` backend ("varlen": flash over packed slots)
    rotates: ClassVar[bool] = False            # takes q and k rotated (`AttentionFn`)
    rope: ClassVar[None] = None                # RoPE from the positions (`decode_forms.text_hidden`)
    layer_options: ClassVar[bool] = True       # takes `sinks` and `window` (`AttentionFn`)

    def __post_init__(self):
        self.layer = 0
        self._cached = None

    latent = DecodeAttention.latent

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        layer = self.layer
        self.layer += 1
        if self.store_rows is None:
            self.kv_cache.store_unchecked(layer, k, v, self.slot_mapping)
        else:       # picked by rows known on the host: a boolean mask would make the host wait for the device
            self.kv_cache.store_unchecked(layer, k.index_select(0, self.store_rows),
                                          v.index_select(0, self.store_rows), self.slot_mapping)
        kc, vc, scales = self.kv_cache.k[layer], self.kv_cache.v[layer], self.kv_cache.layer_scales(layer)
        a = self.num_fresh_tokens
        b = a + (0 if self.single is None else self.single[1].shape[0])
        outs = []
        if self.fresh is not None:
            outs.append(self.fresh(q[:a], k[:a], v[:a], sinks=sinks, window=window))
        if self.single is not None:
            outs.append(decode_with(self.decode_backend, q[a:b], kc, vc, *self.single, sinks=sinks, window=window,
                                    scales=scales))
        cu, ctx, tables = self.rest
        if ctx:
            if self._cached is None:                # built once, used by every layer
                self._cached = CachedPrefill(cu, ctx, tables, q.device, self.cached_backend)
            outs.append(self._cached(q[b:], kc, vc, sinks=sinks, window=window, scales=scales))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
