"""Attention over the paged KV cache in pure PyTorch: the reference path (CPU tests, any device).

Both functions read every key from the cache (the new tokens' K/V are stored first), so a sequence
whose prefix blocks another sequence of the same batch is writing sees them. GQA is handled by SDPA's
`enable_gqa`. Faster kernels (FlexAttention, Triton paged decode) must agree with these.

GPT-OSS's layers add a learned sink logit per head (`sinks`) and, in its sliding layers, a window (`window`: a query
sees itself and the window - 1 positions before it); with either, the attention is the explicit softmax of
`lathe.models.attention.sink_attention` over the same gathered context and mask; the Triton decode kernel has both
(`triton_decode.paged_decode`).

An FP8 cache (`kv_cache`'s module doc) comes with `scales` = (k_scale, v_scale): the gathered context is dequantised
into q's dtype (`gathered`) and attended as before.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch
import torch.nn.functional as F

from lathe import device as accel
from lathe.engine import choices
from lathe.engine.kv_cache import as_bytes, dequantize, quantize
from lathe.models.attention import (causal_varlen, flash_with_options, sink_attention,
                                    varlen_aligns_causal_at_end)

log = logging.getLogger(__name__)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, max_blocks) block ids -> (B, max_blocks * block_size, kv_heads, head_dim) contiguous context."""
    b, nb = block_tables.shape
    g = as_bytes(cache)[block_tables].view(cache.dtype)       # (B, nb, bs, Hkv, D)
    return g.reshape(b, nb * cache.shape[1], *cache.shape[2:])


def gathered(cache: torch.Tensor, scale: torch.Tensor | None, block_tables: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """`gather_kv` in `dtype`: dequantised by the cache's per-token, per-head `scale` when it is FP8."""
    g = gather_kv(cache, block_tables)
    return g.to(dtype) if scale is None else dequantize(g, gather_kv(scale, block_tables), dtype)


def gathered_slots(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The tokens at `slots` (N,) of a (blocks, block_size, Hkv, D) cache as (N, Hkv, D) in `dtype` (an FP8 cache
    dequantised by its per-token, per-head `scale`)."""
    g = as_bytes(cache).flatten(0, 1).index_select(0, slots).view(cache.dtype)
    return g.to(dtype) if scale is None else dequantize(g, scale.flatten(0, 1).index_select(0, slots), dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: list[int], context_lens: list[int], block_tables: list[list[int]],
                      scale: float | None = None, sinks: torch.Tensor | None = None,
                      window: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """Causal attention of ragged new tokens over their whole context.

    q: (T, Hq, D), sequences laid end to end by `cu_seqlens_q`; sequence i's new tokens are the last
    `n_i` of its `context_lens[i]` tokens, whose K/V are in the blocks `block_tables[i]`.
    """
    outs = []
    for i, ctx in enumerate(context_lens):
        start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        n = end - start
        table = torch.tensor(block_tables[i], device=q.device)[None]
        ks, vs = scales or (None, None)
        k = gathered(k_cache, ks, table, q.dtype)[0, :ctx].transpose(0, 1)[None]   # (1, Hkv, ctx, D)
        v = gathered(v_cache, vs, table, q.dtype)[0, :ctx].transpose(0, 1)[None]
        qs = q[start:end].transpose(0, 1)[None]                        # (1, Hq, n, D)
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos       # (n, ctx)
        if window is not None:
            mask = mask & (torch.arange(ctx, device=q.device)[None, :] > qpos - window)
        if sinks is not None or window is not None:
            outs.append(sink_attention(qs, k, v, mask, sinks, scale)[0].transpose(0, 1))
            continue
        out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=qs.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


class CachedPrefill:
    """`prefill_attention` for a whole group at once. With `backend` "varlen" (CUDA, fp16/bf16, where flash
    attention aligns a causal mask with fewer queries than keys at the keys' end: `varlen_aligns_causal_at_end`),
    every sequence's context is gathered by its slots into one packed stream and attended in one flash call per layer
    (sinks and windows on the flash kernel where its check passed: `flash_with_options`). Otherwise, and as that
    path's fallback, the contexts are gathered into one padded batch and attended by masked SDPA in slices (the
    per-sequence loop cost a kernel launch per sequence and layer, which made the agent loop's next-turn prefills, a
    hundred sequences of a few hundred new tokens each, take ~0.4 s a step). The padded form repeats the KV heads
    and pads every sequence to the longest context and query count; the packed one does neither.

    Built once per forward from the group's host-side layout and called for each layer with its cache."""

    def __init__(self, cu_seqlens_q: list[int], context_lens: list[int], block_tables: list[list[int]],
                 device: torch.device, backend: str = "sdpa"):
        self.new = [cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(context_lens))]
        self.batch, self.max_new, self.max_ctx = len(self.new), max(self.new), max(context_lens)
        self.layout = (cu_seqlens_q, context_lens, block_tables)
        self.device = device
        self.varlen = backend == "varlen"
        self.packed: tuple | None = None            # the varlen form's (slots, cu_q, cu_k), built at the first call
        self.rows = None                            # the padded form's layout, built where it runs
        if not self.varlen:
            self._build_padded()

    def _build_padded(self) -> None:
        _, context_lens, block_tables = self.layout
        device, n = self.device, self.new
        width = max(len(t) for t in block_tables)
        tables = [t + [t[0]] * (width - len(t)) for t in block_tables]
        self.tables = torch.tensor(tables, device=device)
        rows = [i * self.max_new + j for i, k in enumerate(n) for j in range(k)]
        self.rows = torch.tensor(rows, device=device)            # packed token -> row of the padded batch
        ctx = torch.tensor(context_lens, device=device)[:, None, None]
        new = torch.tensor(n, device=device)[:, None, None]
        qpos = ctx - new + torch.arange(self.max_new, device=device)[None, :, None]     # (B, max_new, 1)
        keys = torch.arange(self.max_ctx, device=device)[None, None, :]
        self.mask = ((keys <= qpos) & (keys < ctx))[:, None]        # (B, 1, max_new, max_ctx)
        self.mask[..., 0] = True            # padded query rows see one key: finite outputs, dropped below
        self.window_masks: dict[int, torch.Tensor] = {}             # the sliding layers' masks, by window
        self.qpos, self.keys = qpos, keys

    def _mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = self.mask & (self.keys > self.qpos - window)[:, None]
        return self.window_masks[window]

    def _packed(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots (sum of contexts,) int64: each sequence's context, token by token; cu_q, cu_k int32)."""
        if self.packed is None:
            cu_seqlens_q, context_lens, block_tables = self.layout
            ctx = np.asarray(context_lens, dtype=np.int64)
            used = -(-ctx // block_size)                            # each sequence's blocks its context fills
            blocks = np.fromiter(itertools.chain.from_iterable(t[:u] for t, u in zip(block_tables, used.tolist())),
                                 dtype=np.int64, count=int(used.sum()))
            pos = np.arange(int(ctx.sum()), dtype=np.int64) - np.repeat(np.cumsum(ctx) - ctx, ctx)
            block = np.repeat(np.cumsum(used) - used, ctx) + pos // block_size
            slots = blocks[block] * block_size + pos % block_size
            cu_k = np.concatenate([[0], np.cumsum(ctx)])
            self.packed = (torch.from_numpy(slots).to(self.device),
                           torch.tensor(cu_seqlens_q, dtype=torch.int32, device=self.device),
                           torch.from_numpy(cu_k.astype(np.int32)).to(self.device))
        return self.packed

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float | None = None, max_elements: int = 1 << 26, sinks: torch.Tensor | None = None,
                 window: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: (T, Hq, D) packed new tokens -> (T, Hq, D). The padded form's slices keep their repeated K (and V)
        under `max_elements` each; with `sinks` or a `window` (module doc), the explicit softmax where flash cannot
        take them."""
        if self.varlen and scale is None and varlen_aligns_causal_at_end(q.device.index or 0, q.dtype):
            slots, cu_q, cu_k = self._packed(k_cache.shape[1])
            ks, vs = scales or (None, None)
            k, v = (gathered_slots(c, s, slots, q.dtype) for c, s in ((k_cache, ks), (v_cache, vs)))
            if sinks is None and window is None:
                return causal_varlen(q, k, v, cu_q, cu_k, self.max_new, self.max_ctx)
            return flash_with_options(q, k, v, sinks, window, cu_q, cu_k, self.max_new, self.max_ctx,
                                      lambda: self._padded(q, k_cache, v_cache, scale, max_elements, sinks, window,
                                                           scales), at_end=True)
        return self._padded(q, k_cache, v_cache, scale, max_elements, sinks, window, scales)

    def _padded(self, q, k_cache, v_cache, scale, max_elements, sinks, window, scales) -> torch.Tensor:
        if self.rows is None:
            self._build_padded()
        mask = self._mask(window)
        explicit = sinks is not None or window is not None
        hq, d = q.shape[1], q.shape[2]
        padded = q.new_zeros(self.batch * self.max_new, hq, d).index_copy_(0, self.rows, q)
        padded = padded.view(self.batch, self.max_new, hq, d).transpose(1, 2)          # (B, Hq, max_new, D)
        out = torch.empty_like(padded)
        step = max(1, max_elements // (hq * self.max_ctx * d))
        for lo in range(0, self.batch, step):
            hi = min(self.batch, lo + step)
            tables = self.tables[lo:hi]
            ks, vs = scales or (None, None)
            k = gathered(k_cache, ks, tables, q.dtype)[:, :self.max_ctx].transpose(1, 2)   # (b, Hkv, ctx, D)
            v = gathered(v_cache, vs, tables, q.dtype)[:, :self.max_ctx].transpose(1, 2)
            if k.shape[1] != hq:            # repeat the KV heads: SDPA's fast masked kernels have no GQA
                k = k.repeat_interleave(hq // k.shape[1], dim=1)
                v = v.repeat_interleave(hq // v.shape[1], dim=1)
            if explicit:
                out[lo:hi] = sink_attention(padded[lo:hi], k, v, mask[lo:hi], sinks, scale)
            else:
                out[lo:hi] = F.scaled_dot_product_attention(padded[lo:hi], k, v, attn_mask=mask[lo:hi], scale=scale)
        return out.transpose(1, 2).reshape(self.batch * self.max_new, hq, d).index_select(0, self.rows)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float | None = None, sinks: torch.Tensor | None = None,
                     window: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """One new token per sequence: q (B, Hq, D); block_tables (B, max_blocks) padded with any valid id;
    context_lens (B,) tokens of each sequence, the new one included. Returns (B, Hq, D). `sinks`, `window`,
    `scales`: module doc."""
    ks, vs = scales or (None, None)
    k = gathered(k_cache, ks, block_tables, q.dtype).transpose(1, 2)              # (B, Hkv, L, D)
    v = gathered(v_cache, vs, block_tables, q.dtype).transpose(1, 2)
    L = k.shape[2]
    mask = (torch.arange(L, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]  # (B,1,1,L)
    if window is not None:
        mask = mask & (torch.arange(L, device=q.device)[None, :] >= context_lens[:, None] - window)[:, None, None, :]
    if sinks is not None or window is not None:
        return sink_attention(q[:, :, None, :], k, v, mask, sinks, scale)[:, :, 0, :]
    if k.shape[1] == 1 and q.shape[1] > 1:
        # one KV head (DeepSeek-V3's latent, `mla.py`): the query heads as one head's queries, so no kernel repeats
        # the context for each head (SDPA's GQA does, outside flash attention, whose head sizes stop at 256)
        return F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=mask, scale=scale)[:, 0]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0, :]


DECODE_BACKENDS = ("auto", "triton", "torch")
DECODE_CANDIDATES = ("triton", "torch")      # what "auto" times on CUDA, in this order
_logged_failures: set[tuple[str, str]] = set()     # (candidate, error) pairs already logged in this process


def decode_with(backend: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, num_splits: int = 1,
                counters: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                window: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                prefix=None) -> torch.Tensor:
    """Decode attention by a resolved backend name ("triton" or "torch"); same contract as `decode_attention`.
    `counters`: the Triton kernel's zeroed merge counters (`paged_decode`), shared by a step's layers. `sinks`,
    `window`, `scales`: module doc. `prefix`: the Triton kernel's shared prefixes (`paged_decode`; the reference reads
    every row's context as it is)."""
    if backend == "triton":
        from lathe.engine.triton_decode import paged_decode
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits=num_splits,
                            counters=counters, sinks=sinks, window=window, scales=scales, prefix=prefix)
    return decode_attention(q, k_cache, v_cache, block_tables, context_lens, sinks=sinks, window=window,
                            scales=scales)


def _time_backend(backend: str, args: tuple, scales=None, repeats: int = 5) -> float:
    decode_with(backend, *args, scales=scales)                      # compile / warm up
    device = args[0].device
    accel.synchronize(device)
    start, end = accel.new_event(device, timing=True), accel.new_event(device, timing=True)
    start.record()
    for _ in range(repeats):
        decode_with(backend, *args, scales=scales)
    end.record()
    accel.synchronize(device)
    return start.elapsed_time(end) / repeats


def choose_decode_backend(requested: str, device: torch.device, dtype: torch.dtype, *, num_heads: int,
                          num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype | None = None
                          ) -> tuple[str, dict[str, float]]:
    """Resolve "auto" by measuring: on CUDA, time each available kernel on a batch-64, 1024-token probe (over a cache
    of `kv_dtype`, by default `dtype`; FP8 with its scales) and keep the fastest; elsewhere the PyTorch reference.
    Returns (backend, {backend: ms per call}).

    A candidate that raises while it is timed is not chosen; its error is logged (once per process for the same
    error), and the choice is logged with every candidate tried. When none runs, the error lists each with its
    error."""
    if requested not in DECODE_BACKENDS:
        raise ValueError(f"decode attention backend {requested!r} is unknown; use one of {', '.join(DECODE_BACKENDS)}")
    from lathe.engine import triton_decode
    if requested == "triton" and not (triton_decode.available() and (device.type == "cuda" or triton_decode.interpreted())):
        raise ValueError("decode attention backend 'triton' needs CUDA and Triton (or TRITON_INTERPRET=1 on CPU); "
                         "use 'torch' or 'auto'")
    if requested != "auto":
        return requested, {}
    if device.type != "cuda" or not triton_decode.available():
        return "torch", {}
    batch, ctx = 64, 1024
    blocks = batch * ctx // block_size
    g = torch.Generator(device=device).manual_seed(0)
    kc = torch.randn(blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    scales = None
    if kv_dtype is not None and kv_dtype != dtype:          # an FP8 cache (`kv_cache`'s module doc)
        (kc, ks), (vc, vs) = quantize(kc), quantize(vc)
        scales = (ks, vs)
    tables = torch.arange(blocks, device=device, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=g)
    probe = (f"decode attention ({dtype}, {num_heads}/{num_kv_heads} heads of {head_dim}, blocks of {block_size}, "
             f"cache {kv_dtype or dtype})")
    return pick_fastest(DECODE_CANDIDATES, lambda name: _time_backend(name, (q, kc, vc, tables, lens), scales),
                        f"decode attention on {device} ({dtype}, {num_heads}/{num_kv_heads} heads of {head_dim})",
                        remember=choices.key(probe, device))


def pick_fastest(candidates, time_one, what: str, *, remember: str | None = None) -> tuple[str, dict[str, float]]:
    """(the candidate with the least `time_one(name)`, {name: time} of those that ran). A candidate that raises is
    skipped and its error logged (once per process for the same candidate and error); the choice is logged with
    what each candidate gave; when none runs, a RuntimeError names `what` and lists each candidate's error.

    With `remember` (a `choices.key`), the choice is the one remembered under it on this machine when that candidate
    still runs (`time_one` of it alone), else it is measured and remembered (`lathe.engine.choices`: processes that
    chose apart would sample apart)."""
    if remember is None:
        return _measure(candidates, time_one, what)
    with choices.held() as writable:            # (the first to measure holds the others until it has chosen)
        known = choices.recall(remember) if writable else None
        if known not in candidates:
            return _measure_and_keep(candidates, time_one, what, remember if writable else None)
    try:                                        # (the check outside the lock: the ranks of a node at once)
        ms = time_one(known)
    except Exception as e:                      # (it ran when it was chosen: a changed machine; measure again)
        log.warning("%s: the remembered choice %r fails here now (%s: %s); measuring again", what, known,
                    type(e).__name__, e)
        with choices.held() as writable:        # (another rank may have measured again meanwhile: take its choice)
            again = choices.recall(remember) if writable else None
            if again in candidates and again != known:
                try:
                    return again, {again: time_one(again)}
                except Exception:
                    pass
            return _measure_and_keep(candidates, time_one, what, remember if writable else None)
    log.info("%s: chose %r, as measured before on this machine (%s; delete it to measure again)", what, known,
             choices.path())
    return known, {known: ms}


def _measure_and_keep(candidates, time_one, what: str, remember: str | None) -> tuple[str, dict[str, float]]:
    best, times = _measure(candidates, time_one, what)
    if remember is not None:
        choices.keep(remember, best)
    return best, times


def _measure(candidates, time_one, what: str) -> tuple[str, dict[str, float]]:
    times, errors = {}, {}
    for name in candidates:
        try:
            times[name] = time_one(name)
        except Exception as e:      # a kernel that fails to build or run here is not chosen; the reason is kept
            errors[name] = f"{type(e).__name__}: {e}"
            if (name, errors[name]) not in _logged_failures:
                _logged_failures.add((name, errors[name]))
                log.warning("%s: candidate %r failed and is not chosen: %s", what, name, errors[name])
    tried = ", ".join(f"{n} {times[n]:.4g} ms" if n in times else f"{n} failed" for n in candidates)
    if not times:
        lines = "\n".join(f"  - {n}: {errors[n]}" for n in candidates)
        raise RuntimeError(f"{what}: no candidate ran; tried {len(candidates)}:\n{lines}\n"
                           "pass a backend explicitly (decode_backend='torch' is the reference) to see the error "
                           "where it happens")
    best = min(times, key=times.get)
    log.info("%s: chose %r of %s", what, best, tried)
    return best, times
