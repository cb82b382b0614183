"""Attention backends, chosen at run time. Each is a callable `(q, k, v) -> out` bound to one batch layout: an
`AttentionFn`, what the decoder's layers call.

Layouts:
- packed: q (T, Hq, D), k/v (T, Hkv, D); sequences laid end to end, delimited by `cu_seqlens` (S+1,),
  attention causal within each sequence and never across.
- padded: q (B, L, Hq, D), k/v (B, L, Hkv, D) with a (B, L) attention mask of real tokens.

Backends for packed batches:
- "varlen": `torch.nn.attention.varlen.varlen_attn` (flash attention; CUDA, fp16/bf16, torch >= 2.9).
  Its causal switch moved: torch 2.9 takes `is_causal=True`, later versions `window_size=(-1, 0)`;
  the signature is probed once. Grouped-query K/V go in at their own head count where the kernel takes them
  (`varlen_takes_gqa`), else repeated to the query heads.
- "fa4": flash-attn-4's CuTe kernels (`lathe.models.flash4`; Hopper and Blackwell, the package installed), chosen
  by `override_config.attn_implementation=flash_attention_4`; never by "auto". GPT-OSS's sinks and windows run on
  the "varlen" kernel as below.
- "sdpa": one `scaled_dot_product_attention(is_causal=True)` per sequence; runs anywhere, the reference.

Per-layer options (GPT-OSS): a layer may hand its attention `sinks` (Hq,), a learned logit per head that joins each
query's softmax denominator (its probability mass goes to no value), and `window`, a sliding window (a query sees
itself and the window - 1 tokens before it). The callables that implement them say so (`layer_options`). Packed
batches on the "varlen" backend run them on the flash kernel (`lathe.models.sink_flash`: the window as flash
attention's local window, the sinks folded into its output and log-sum-exp, the backward flash attention's own),
where a check of that head layout against the explicit form passes on the device; elsewhere (padded batches, the
"sdpa" backend, a layout that fails its check) they run as one explicit softmax per sequence (`sink_attention`, in
query slices of bounded size, each recomputed in backward): correct, not fused.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lathe.config.rules_attention import ATTN_IMPLEMENTATIONS, KEY as ATTN_KEY, attn_implementation_problem

PACKED_BACKENDS = ("auto", "varlen", "fa4", "sdpa")
FLASH_BACKENDS = ("varlen", "fa4")      # the flash kernels: packed causal attention in one call


class AttentionFn(Protocol):
    """What the decoder's layers call for attention: q (..., Hq, D), k and v (..., Hkv, D) -> (..., Hq, D).

    `rotates`: False, the layers hand over q and k already rotated (RoPE); True, they hand over q and k before RoPE
    and `(cos, sin)` as two more arguments, and the attention rotates them itself (the engine's decode step, which
    rotates and stores in one launch)."""

    rotates: bool
    layer_options: bool     # takes `sinks=` and `window=` keywords (module doc); absent: it does not

    def __call__(self, q, k, v, *rope, **options): ...


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor | None = None, scale: float | None = None,
                   max_elements: int = 1 << 27) -> torch.Tensor:
    """softmax([q k^T * scale, sink]) without the sink's column, times v: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D),
    `mask` boolean, broadcastable to (B, Hq, Lq, Lk), True where a query sees a key; `sinks` (Hq,) or None (plain
    masked attention). Computed in float32 (logits max-subtracted), returned in q's dtype. A query that sees no key
    gets a zero output (only the sink, or nothing). The queries go in slices whose float32 logits stay under
    `max_elements`; with gradients, each slice is recomputed in backward rather than kept (activation checkpointing),
    so memory holds one slice's logits at a time, not heads x Lq x Lk."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lq, per_query = q.shape[2], q.shape[0] * q.shape[1] * k.shape[2]
    step = max(1, max_elements // max(per_query, 1))
    if step >= lq:
        return _sink_slice(q, k, v, mask, sinks, scale)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    outs = []
    for lo in range(0, lq, step):
        part = mask if mask.shape[-2] == 1 else mask[..., lo:lo + step, :]
        args = (q[:, :, lo:lo + step], k, v, part, sinks, scale)
        outs.append(checkpoint(_sink_slice, *args, use_reentrant=False) if grads else _sink_slice(*args))
    return torch.cat(outs, dim=2)


def _sink_slice(q, k, v, mask, sinks, scale) -> torch.Tensor:
    """`sink_attention` of a slice of the queries, k and v at the query heads."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    top = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min).detach()
    probs = torch.exp(logits - top)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Lq, Lk) True where query position `q_pos[i]` sees key position `k_pos[j]`: causal, and within the window."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    return mask if window is None else mask & (diff < window)


def refuse_layer_options(attn, options: dict) -> None:
    """Raise when a layer hands per-layer options (sinks, a sliding window) to an attention that lacks them."""
    if options and not getattr(attn, "layer_options", False):
        names = " and ".join(f"{k}={'(learned)' if k == 'sinks' else v}" for k, v in options.items())
        raise ValueError(f"{type(attn).__name__} does not implement attention sinks or sliding windows (this "
                         f"model's layers need {names}: GPT-OSS). lathe runs these layers on its packed, padded, "
                         "Ulysses and engine attentions only (no prefix-grouped forward). Fix: "
                         "turn the feature that built this attention off for this model")


@functools.cache
def varlen_signature() -> frozenset[str] | None:
    """Keyword names of `varlen_attn`, or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def varlen_takes_gqa(device_index: int, dtype: torch.dtype) -> bool:
    """Whether `varlen_attn` computes grouped-query attention from K/V at their own head count: its `enable_gqa`
    flag where it has one; else whether the flash kernel, given fewer K/V heads (which it supports natively), gives
    the repeated-heads result, output and gradients, on a small causal batch (probed once per device and dtype).
    Repeating K/V costs a copy of each and a reduction of their gradients per layer."""
    params = varlen_signature()
    if params is None:
        return False
    if "enable_gqa" in params:
        return True
    from torch.nn.attention.varlen import varlen_attn
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    results = []
    try:
        with torch.inference_mode(False), torch.enable_grad():      # the first caller may be the engine's prefill
            g = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)
            q, k, v = (torch.randn(24, heads, 64, device=f"cuda:{device_index}", generator=g, dtype=dtype)
                       for heads in (4, 2, 2))
            grad = torch.randn(q.shape, device=q.device, generator=g, dtype=dtype)
            cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=q.device)
            for grouped in (True, False):
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                kr, vr = (kk, vv) if grouped else (_repeat_kv(kk, 2, 1), _repeat_kv(vv, 2, 1))
                out = varlen_attn(qq, kr, vr, cu, cu, 15, 15, **kwargs)
                results.append([out, *torch.autograd.grad(out, (qq, kk, vv), grad)])
    except (RuntimeError, ValueError):
        return False
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
               for a, b in zip(*results))


def set_attention(model, value, device: torch.device, dtype: torch.dtype) -> None:
    """Run `model`'s attention on what `ATTN_KEY`'s `value` names (None: "auto"): lathe's decoder's packed backend,
    checked now against the device and the compute dtype so that a backend that cannot run fails before training; a
    transformers model (`model.impl=hf`) through transformers' own `set_attn_implementation` (flash-attn-4 is lathe's
    decoder's alone)."""
    if value is None:
        return
    problem = attn_implementation_problem(value)
    if problem:
        raise ValueError(problem)
    if not hasattr(model, "attn_backend"):
        if value == "flash_attention_4" or not hasattr(model, "set_attn_implementation"):
            raise ValueError(f"{ATTN_KEY}={value}: {type(model).__name__} is not lathe's decoder, which runs "
                             "flash-attn-4's kernels. Fix: set actor_rollout_ref.model.impl=lathe (or auto), or "
                             "flash_attention_2/sdpa/eager for the transformers model")
        try:
            model.set_attn_implementation(value)
        except (ImportError, ValueError) as e:
            raise ValueError(f"{ATTN_KEY}={value}: transformers cannot run it for {type(model).__name__}: {e}. Fix: "
                             "sdpa, or install what it names") from e
        return
    backend = ATTN_IMPLEMENTATIONS[value]
    try:
        select_packed_backend(backend, device, dtype)
    except ValueError as e:
        raise ValueError(f"{ATTN_KEY}={value}: {e}") from e
    model.attn_backend = backend


def select_packed_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve "auto" to "varlen" where flash attention can run, else "sdpa"; validate explicit choices."""
    if requested not in PACKED_BACKENDS:
        raise ValueError(f"attention backend {requested!r} is unknown; use one of {', '.join(PACKED_BACKENDS)}")
    varlen_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_signature() is not None
    if requested == "varlen" and not varlen_ok:
        raise ValueError(f"attention backend 'varlen' needs CUDA, fp16/bf16 and torch >= 2.9 (have device="
                         f"{device.type}, dtype={dtype}, torch {torch.__version__}); use 'sdpa' or 'auto'")
    if requested == "fa4":
        from lathe.models import flash4
        why = flash4.unavailable(device, dtype)
        if why:
            raise ValueError(f"attention backend 'fa4' (flash-attn-4's kernels) cannot run here: {why}. Fix: "
                             "flash_attention_2 (torch's flash attention), or leave the choice out")
    if requested == "auto":
        return "varlen" if varlen_ok else "sdpa"
    return requested


def _repeat_kv(x: torch.Tensor, groups: int, head_dim_axis: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=head_dim_axis)


@dataclass
class PackedAttention:
    """Causal attention within each packed sequence."""

    cu_seqlens: torch.Tensor      # (S+1,) int32, on the tokens' device
    max_seqlen: int
    backend: str = "sdpa"
    rotates: ClassVar[bool] = False     # takes q and k rotated (`AttentionFn`)
    layer_options: ClassVar[bool] = True

    def __post_init__(self):
        self._bounds = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        if sinks is not None or window is not None:
            if self.backend in FLASH_BACKENDS:
                return self._flash_with_options(q, k, v, sinks, window)
            return self._explicit(q, k, v, sinks, window)
        if self.backend in FLASH_BACKENDS:
            cu = self.cu_seqlens.to(torch.int32)
            return flash_causal(self.backend, q, k, v, cu, cu, self.max_seqlen, self.max_seqlen)
        return self._sdpa(q, k, v)

    def _flash_with_options(self, q, k, v, sinks, window) -> torch.Tensor:
        cu = self.cu_seqlens.to(torch.int32)
        return flash_with_options(q, k, v, sinks, window, cu, cu, self.max_seqlen, self.max_seqlen,
                                  lambda: self._explicit(q, k, v, sinks, window))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._bounds is None:   # one host sync per forward, shared by all layers
            self._bounds = self.cu_seqlens.tolist()
        groups = q.shape[1] // k.shape[1]
        # past flash attention's head sizes (256: DeepSeek-V3's latent in the engine) the KV heads are repeated, so
        # that the memory-efficient kernel runs; SDPA's GQA would fall to the math form and its (heads, T, T) scores
        repeat = groups > 1 and q.shape[-1] > 256
        outs = []
        for start, end in zip(self._bounds[:-1], self._bounds[1:]):
            if end == start:
                continue
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            if repeat:
                ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=groups > 1 and not repeat)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)

    def _explicit(self, q, k, v, sinks, window) -> torch.Tensor:
        """Per sequence, the explicit softmax with sinks and a window (`segment_attention`)."""
        if self._bounds is None:
            self._bounds = self.cu_seqlens.tolist()
        return segment_attention(q, k, v, self._bounds, self._bounds, sinks, window)



FLASH_BACKENDS = ("varlen", "fa4")


def flash_causal(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int) -> torch.Tensor:
    """`causal_varlen` on flash attention 2 ("varlen") or on flash-attn-4's kernels ("fa4"); the same layout and
    the same causal alignment (each sequence's queries are the last of its keys)."""
    if backend == "fa4":
        from lathe.models import flash4
        return flash4.causal(q, k, v, cu_q, cu_k, max_q, max_k)
    return causal_varlen(q, k, v, cu_q, cu_k, max_q, max_k)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int) -> torch.Tensor:
    """Flash `varlen_attn`, causal, K/V at their own head count where this torch computes GQA from them (else
    repeated): (T, Hq, D) queries over each sequence's keys; with fewer queries than keys in a sequence, the causal
    mask is aligned at its end (`varlen_aligns_causal_at_end` says where that holds)."""
    from torch.nn.attention.varlen import varlen_attn
    params = varlen_signature()
    kwargs = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    elif q.shape[1] != k.shape[1] and not varlen_takes_gqa(q.device.index, q.dtype):
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def causal_at_end(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """(queries, keys) bool: query i sees keys 0 .. keys - queries + i (the queries are the last of the keys)."""
    last = keys - queries + torch.arange(queries, device=device)
    return torch.arange(keys, device=device)[None, :] <= last[:, None]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bounds: list[int], k_bounds: list[int],
                      sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """The explicit softmax (`sink_attention`: sinks, a sliding window) over packed segments: segment s's queries
    q[q_bounds[s]:q_bounds[s+1]] (T, Hq, D) are the last of its keys k/v[k_bounds[s]:k_bounds[s+1]] (equal bounds:
    causal attention within each packed sequence)."""
    outs = []
    for a, b, c, d in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        if b == a:
            continue
        qs, ks, vs = q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None]
        mask = window_mask(torch.arange(d - c - (b - a), d - c, device=q.device), torch.arange(d - c, device=q.device),
                           window)
        outs.append(sink_attention(qs, ks, vs, mask, sinks)[0].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


@torch.compiler.disable     # (its one-time check and the custom backward run eagerly, as the explicit form does)
def flash_with_options(q, k, v, sinks, window, cu_q, cu_k, max_q: int, max_k: int, explicit,
                       at_end: bool = False) -> torch.Tensor:
    """Sinks and a window on the flash kernel (`lathe.models.sink_flash`) where its check at this head layout (and,
    `at_end`: segments with fewer queries than keys, at that alignment) passed on this device, else `explicit()`."""
    from lathe.models.sink_flash import flash_sink_attention, flash_sinks_agree
    if q.shape[1] != k.shape[1] and not varlen_takes_gqa(q.device.index, q.dtype):
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
    if not flash_sinks_agree(q.device.index or 0, q.dtype, q.shape[1], k.shape[1], q.shape[2], window,
                             sinks is not None, at_end):
        return explicit()
    return flash_sink_attention(q, k, v, sinks, cu_q, max_q, window, cu_k=cu_k, max_k=max_k)


@functools.cache
def varlen_aligns_causal_at_end(device_index: int, dtype: torch.dtype) -> bool:
    """Whether `causal_varlen` with fewer queries than keys in a sequence masks as `causal_at_end` (flash attention
    2.1 and later do; probed once per device and dtype against SDPA with that mask)."""
    if varlen_signature() is None:
        return False
    try:
        g = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)
        q, k, v = (torch.randn(n, 2, 64, device=f"cuda:{device_index}", generator=g, dtype=dtype) for n in (5, 19, 19))
        cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, 9, 19], dtype=torch.int32, device=q.device)
        out = causal_varlen(q, k, v, cu_q, cu_k, 3, 10)
        ref = torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
            attn_mask=causal_at_end(b - a, d - c, q.device)).transpose(0, 1)
            for a, b, c, d in ((0, 2, 0, 9), (2, 5, 9, 19))])
    except (RuntimeError, ValueError):
        return False
    return torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@dataclass
class GroupedLinear:
    """The prefix-grouped stream (`GroupedAttention`) as a linear-attention layer runs it (`GatedDeltaNet.grouped`):
    the prompts' tokens (the stream's first `prompt_tokens` rows) as packed sequences from a zero state, then each
    response (the rest, in order) as a sequence of its own that continues from its prompt's final states. Its short
    convolution sees the prompt's last K-1 inputs before the response's first token: each response is convolved
    behind a copy of those (`extended`) and the copies' outputs dropped (`kept`), in one convolution with the
    prompts (`cu_conv`). Index tensors are int64 on the stream's device, bounds int32; sizes and maxima on the
    host."""

    prompt_tokens: int          # Tp: the stream's first Tp rows are the prompts' tokens, prompt by prompt
    cu_prompt: torch.Tensor     # (G+1,)
    max_prompt: int
    extended: torch.Tensor      # (Te,) stream rows: each response behind its prompt's last min(K-1, prompt) tokens
    cu_conv: torch.Tensor       # (G+R+1,) the convolution's sequences over [the Tp prompt rows, `extended`]
    kept: torch.Tensor          # (T-Tp,) the response tokens' places in `extended`
    cu_response: torch.Tensor   # (R+1,) the responses in the stream's rows Tp: (response by response)
    max_response: int
    group: torch.Tensor         # (R,) each response's prompt (an index into the G prompts)


@dataclass
class GroupedAttention:
    """Causal attention over a packed stream of segments whose keys are gathered from the stream: the prefix-grouped
    forward (`lathe.train.prefix_group`), where a prompt's segment sees itself and each of its responses' segments
    sees the prompt, then itself. Segment s holds stream tokens cu_q[s]:cu_q[s+1] as queries and the stream rows
    kv_index[cu_k[s]:cu_k[s+1]] as keys, its queries being the last of its keys (`causal_at_end`). On flash attention
    (`backend` "varlen", where `varlen_aligns_causal_at_end`) in one call; else SDPA per segment."""

    cu_q: torch.Tensor          # (S+1,) int32
    cu_k: torch.Tensor          # (S+1,) int32, over the gathered keys
    kv_index: torch.Tensor      # (Tk,) int64 stream rows
    max_q: int
    max_k: int
    backend: str = "sdpa"
    bounds: tuple[list[int], list[int]] | None = None   # cu_q and cu_k on the host where known (else read back once)
    linear: GroupedLinear | None = None     # the same stream for linear-attention layers (Qwen3.5, Qwen3-Next)
    rotates: ClassVar[bool] = False     # takes q and k rotated (`AttentionFn`)
    layer_options: ClassVar[bool] = True    # sinks and sliding windows (GPT-OSS)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        k, v = k.index_select(0, self.kv_index), v.index_select(0, self.kv_index)
        options = sinks is not None or window is not None
        if self.backend == "fa4" and not options:
            return flash_causal(self.backend, q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k)
        if self.backend in FLASH_BACKENDS and varlen_aligns_causal_at_end(q.device.index or 0, q.dtype):
            if not options:
                return causal_varlen(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k)
            return flash_with_options(q, k, v, sinks, window, self.cu_q, self.cu_k, self.max_q, self.max_k,
                                      lambda: segment_attention(q, k, v, *self._host_bounds(), sinks, window),
                                      at_end=True)
        if options:
            return segment_attention(q, k, v, *self._host_bounds(), sinks, window)
        gqa = q.shape[1] != k.shape[1]
        outs = []
        q_bounds, k_bounds = self._host_bounds()
        for a, b, c, d in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
            qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
            out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], enable_gqa=gqa,
                                                 attn_mask=causal_at_end(b - a, d - c, q.device))
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, dim=0)

    def _host_bounds(self) -> tuple[list[int], list[int]]:
        if self.bounds is None:         # one host sync per forward, shared by all layers
            self.bounds = (self.cu_q.tolist(), self.cu_k.tolist())
        return self.bounds


@dataclass
class PaddedAttention:
    """Causal attention over a padded (B, L) batch; pad keys are masked out.

    Every query may also see itself, so that rows made only of padding give finite (ignored) outputs
    instead of NaN, which would otherwise leak into gradients through `0 * NaN`.
    """

    attention_mask: torch.Tensor | None   # (B, L), 1 for real tokens; None = no padding
    rotates: ClassVar[bool] = False       # takes q and k rotated (`AttentionFn`)
    layer_options: ClassVar[bool] = True

    def __post_init__(self):
        self._mask = None
        self._bounds: tuple | None = None     # (rows, length, device, cu_seqlens): `row_bounds`
        if self.attention_mask is not None:
            L = self.attention_mask.shape[1]
            device = self.attention_mask.device
            causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
            keys = self.attention_mask.bool()[:, None, None, :]                     # (B, 1, 1, L)
            diag = torch.eye(L, dtype=torch.bool, device=device)
            self._mask = causal & (keys | diag)                                     # (B, 1, L, L)

    @torch.compiler.disable        # (eager: a compiled layer would guard on the memo and recompile for it)
    def row_bounds(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """The cu_seqlens (int32) of the batch's rows laid end to end, each a sequence of `length`: one tensor for
        every layer of the forward (the linear-attention layers hand it to fla, which memoises what it derives from
        the bounds by the tensor's identity; a new tensor per layer was a host sync per layer)."""
        if self._bounds is None or self._bounds[:3] != (rows, length, device):
            cu = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)
            self._bounds = (rows, length, device, cu)
        return self._bounds[3]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))                           # (B, H, L, D)
        gqa = q.shape[1] != k.shape[1]
        if sinks is not None or window is not None:     # window by index: padding lies outside every real row
            pos = torch.arange(q.shape[2], device=q.device)
            mask = window_mask(pos, pos, window) if self._mask is None else \
                self._mask & window_mask(pos, pos, window)
            return sink_attention(q, k, v, mask, sinks).transpose(1, 2)
        if self._mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask, enable_gqa=gqa)
        return out.transpose(1, 2)
