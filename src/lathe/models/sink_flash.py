"""Packed attention with sinks and a sliding window on the flash kernel (GPT-OSS's layers in training and prefill).

A sink is a learned logit per head that joins each query's softmax denominator and sends its probability to no value:
with s_j the query's scores and lse = log sum_j exp(s_j) (what flash attention returns beside its output o),

    o' = sum_j exp(s_j) v_j / (exp(lse) + exp(sink)) = o * exp(lse - lse'),   lse' = logaddexp(lse, sink).

The backward needs no kernel of its own: flash attention's backward recomputes each probability as exp(s_j - lse)
from the log-sum-exp it is handed and takes D = rowsum(do * o) from the output it is handed, so handed (o', lse') it
computes the sinked softmax's dq, dk and dv exactly (the sink is one more column whose value row is zero). The sink's
own gradient is -sum_i p_sink_i D_i over the head's queries, p_sink_i = exp(sink - lse'_i).

The window is flash attention's local window: a query sees itself and the `window - 1` keys before it
(`lathe.models.attention.window_mask`). Without sinks or a window the plain path (`attention.flash_causal`) runs.
A sequence may hold fewer queries than keys (`cu_k`: the prefix-grouped forward's segments, whose queries are the last
of their keys): flash attention aligns its causal mask and its window at the sequence's end, as that forward needs.

`flash_sink_attention` runs on CUDA through `torch.ops.aten._flash_attention_forward/_backward` (the ops
`torch.nn.attention.varlen` calls). Whether it is used is decided once per device, dtype and head layout by
`flash_sinks_agree`: its output and every gradient on a small packed batch against `sink_attention` (the explicit
float32 form); a layout that fails, or an op that raises, keeps the explicit form, with a warning. The math is
tested on the CPU with a reference core of the same contract (tests/models/test_sink_flash.py, float64).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)
AGREEMENT = 2e-2        # norm-relative, bf16 against the float32 explicit form (outputs and gradients)


def _window_left(window: int | None) -> int:
    return -1 if window is None else window - 1


def flash_core(q, k, v, cu_q, cu_k, max_q, max_k, window, scale):
    """(out, lse (H, Tq) float32, rng state) of flash attention's varlen forward, causal within each sequence
    (aligned at its end where it has fewer queries than keys)."""
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
        window_size_left=_window_left(window), window_size_right=0)
    return out, lse, (rng, unused)


def flash_core_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, window, scale, state):
    rng, unused = state
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale,
        window_size_left=_window_left(window), window_size_right=0)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, window, scale, core, core_backward):
        out, lse, state = core(q, k, v, cu_q, cu_k, max_q, max_k, window, scale)
        lse2 = lse if sinks is None else torch.logaddexp(lse, sinks.float()[:, None])      # (H, T)
        if sinks is not None:
            out = (out.float() * torch.exp(lse - lse2).transpose(0, 1)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse2, sinks, cu_q, cu_k)
        ctx.args = (max_q, max_k, window, scale, state, core_backward, sinks is not None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, sinks, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, window, scale, state, core_backward, has_sinks = ctx.args
        dout = dout.contiguous()
        dq, dk, dv = core_backward(dout, q, k, v, out, lse2, cu_q, cu_k, max_q, max_k, window, scale, state)
        dsinks = None
        if has_sinks and ctx.needs_input_grad[3]:
            d = (dout.float() * out.float()).sum(-1).transpose(0, 1)         # (H, T)
            dsinks = -(torch.exp(sinks.float()[:, None] - lse2) * d).sum(-1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None


@torch.compiler.disable      # (a custom backward around the flash ops: eager, as the explicit form it replaces)
def flash_sink_attention(q, k, v, sinks, cu_seqlens, max_len, window, scale=None, *, cu_k=None, max_k=None,
                         core=None, core_backward=None):
    """Causal attention within each packed sequence (q (T, Hq, D), k/v (T, Hkv, D), `cu_seqlens` (S+1,) int32) with
    `sinks` (Hq,) or None and a sliding `window` or None: `sink_attention`'s result (module doc). `cu_k`, `max_k`:
    the sequences' keys where they are not the queries (k/v (Tk, Hkv, D); each sequence's queries the last of its
    keys). `core` and `core_backward`: the flash ops (default) or stand-ins of their contract (the CPU tests')."""
    core, core_backward = core or flash_core, core_backward or flash_core_backward
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.contiguous() for x in (q, k, v))
    cu_k, max_k = (cu_seqlens, max_len) if cu_k is None else (cu_k, max_k)
    return _SinkAttention.apply(q, k, v, sinks, cu_seqlens, cu_k, max_len, max_k, window, scale, core, core_backward)


@functools.cache
def flash_sinks_agree(device_index: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                      window: int | None, sinks: bool, at_end: bool = False) -> bool:
    """Whether `flash_sink_attention` on this CUDA device gives `sink_attention`'s output and gradients at this head
    layout (`check_errors`; `at_end`: on sequences with fewer queries than keys), checked once; False (with one
    warning) where it does not, or where the flash ops raise."""
    device = torch.device("cuda", device_index)
    try:
        errs = check_errors(device, dtype, heads, kv_heads, head_dim, window, sinks, at_end=at_end)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        log.warning("attention with sinks/windows: the flash kernel failed its check on %s (%s: %s); these layers "
                    "run the explicit softmax", device, type(e).__name__, e)
        return False
    if all(e <= AGREEMENT for e in errs.values()):
        return True
    log.warning("attention with sinks/windows: the flash kernel disagrees with the explicit softmax on %s at %d/%d "
                "heads of %d, window %s%s (norm-relative %s); these layers run the explicit softmax", device, heads,
                kv_heads, head_dim, window, ", fewer queries than keys" if at_end else "",
                ", ".join(f"{n} {e:.3g}" for n, e in errs.items()))
    return False


def check_errors(device, dtype, heads: int, kv_heads: int, head_dim: int, window: int | None, sinks: bool, *,
                 at_end: bool = False, core=None, core_backward=None) -> dict[str, float]:
    """Norm-relative errors of `flash_sink_attention` (output, dq, dk, dv, dsinks) against the explicit float32 form
    on a packed batch of three sequences (one longer than the window; `at_end`: their queries the last 15, 5 and 60
    of their keys). A window is checked at 4 tokens, whatever its size: the kernel treats every size alike, and at 4
    a window one key too wide or too narrow moves each row by a quarter of its weight (at GPT-OSS's 128, by less than
    the tolerance)."""
    from lathe.models.attention import segment_attention
    keys = (37, 5, 150)
    queries = (15, 5, 60) if at_end else keys
    window = None if window is None else min(window, 4)
    with torch.inference_mode(False), torch.enable_grad():       # (the first caller may be the engine's prefill)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(sum(queries), heads, head_dim, device=device, generator=g).to(dtype)
        k, v = (torch.randn(sum(keys), kv_heads, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
        s = (torch.randn(heads, device=device, generator=g) * 2).to(dtype) if sinks else None
        grad = torch.randn(sum(queries), heads, head_dim, device=device, generator=g).to(dtype)
        bounds = [[0, *torch.tensor(n).cumsum(0).tolist()] for n in (queries, keys)]
        cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device=device) for b in bounds)
        leaves = [x.detach().requires_grad_() for x in (q, k, v, *([s] if sinks else []))]
        out = flash_sink_attention(*leaves[:3], leaves[3] if sinks else None, cu_q, max(queries), window, cu_k=cu_k,
                                   max_k=max(keys), core=core, core_backward=core_backward)
        got = [out, *torch.autograd.grad(out, leaves, grad)]
        ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
        ref = segment_attention(*ref_leaves[:3], *bounds, ref_leaves[3] if sinks else None, window)
        want = [ref, *torch.autograd.grad(ref, ref_leaves, grad.float())]
    names = ("output", "dq", "dk", "dv", "dsinks")
    return {n: float((a.detach().float() - b.detach()).norm() / b.detach().norm().clamp_min(1e-12))
            for n, a, b in zip(names, got, want)}
