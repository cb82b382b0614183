"""The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024) and the short causal
convolution before it: the token mixer of the linear-attention layers of Qwen3.5 and Qwen3-Next.

Per head, with q and k L2-normalised and q scaled by 1/sqrt(d_k), a state S (d_k, d_v) runs over the tokens of one
sequence, starting at zero (or at a given state):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,        o_t = S_t^T q_t

with g_t <= 0 the log decay and beta_t in (0, 1) the write strength. Each key head serves
`value heads / key heads` consecutive value heads.

Two torch forms, the CPU path and the reference:
- `chunk_gated_delta_rule`: the chunked (WY / UT-transform) form: within a chunk of C tokens, with gamma the chunk's
  cumulative log decay, A = I + strict_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)), U = A^-1 (beta v) and
  W = A^-1 (beta k exp(gamma)); then per chunk v' = U - W S, o = (q exp(gamma)) S + causal(q_i.k_j exp(gamma_i -
  gamma_j)) v', S <- exp(gamma_C) S + (k exp(gamma_C - gamma))^T v'. Packed sequences (`cu_seqlens`) are laid out
  as rows of one padded batch, so every sequence starts from its own state; padded steps have g = 0, beta = 0, k = 0
  and change nothing.
- `recurrent_gated_delta_rule`: token by token (a decode step is one token).

On CUDA, when `fla` (the `flash-linear-attention` wheel, lathe's `hybrid` extra) imports, its Triton kernels
(`chunk_gated_delta_rule` for sequences, `fused_recurrent_gated_delta_rule` for single steps) run instead, with the
same arguments; without it the torch form runs there too, with a one-time notice. On a machine where fla's kernels
have not run, Triton compiles and autotunes each of their configurations at the first call of a layout (minutes
in all, kept in Triton's cache after): `first_use` watches each layout's first forward and backward and says so
when one passes FIRST_USE_NOTICE_S, so the wait does not read as a hang.

`causal_conv1d`: the depthwise causal convolution over each packed sequence (zero history), then SiLU (fla's kernels
on CUDA when it imports and no history is given: training, log-prob and reference passes, the engine's prefill steps
of fresh sequences; a prefill step that continues given states takes the torch form);
`conv_step`: the same for one new token per sequence after its carried inputs (a decode step: one cat and one
product, no search over the packed bounds).
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import torch
import torch.nn.functional as F

from lathe.device import nvidia_capability, use_device

log = logging.getLogger("lathe")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (as fla and transformers compute it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(T,) each token's index within its packed sequence."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], torch.arange(total, device=cu.device), right=True)
    return torch.arange(total, device=cu.device) - cu[seq]


@torch.compiler.disable
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                  initial: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv (+ `bias` (C,))) of a packed stream x (T, C) with `weight` (C, K); each sequence
    sees only its own earlier tokens (and `initial` (S, C, K-1), the last K-1 inputs before it, when given; else
    zeros). From zero history on CUDA with fla installed, fla's Triton kernels (forward and backward) run it."""
    conv = fla_conv() if initial is None and x.device.type == "cuda" else None
    if conv is not None:
        extra = {} if bias is None else {"bias": bias.to(x.dtype)}      # (Qwen3.5's call stays as it was)
        watch = first_use("causal convolution", ("conv", x.device, *weight.shape, x.dtype, bias is None,
                                                 x.requires_grad), lambda: f"{weight.shape[0]} channels, kernel "
                          f"{weight.shape[-1]}, {str(x.dtype)[6:]}")
        y, _ = watched(watch, lambda x: conv(x.unsqueeze(0), weight=weight.to(x.dtype), activation="silu",
                                             cu_seqlens=fla_cu_seqlens(cu_seqlens), backend="triton", **extra), x)
        return y[0]
    total, kernel = x.shape[0], weight.shape[-1]
    pos = positions_in_sequence(cu_seqlens, total)
    w = weight.to(x.dtype)
    out = x * w[:, kernel - 1] if bias is None else x * w[:, kernel - 1] + bias.to(x.dtype)
    for j in range(1, kernel):         # the input j steps back, where it is in the same sequence
        shifted = F.pad(x, (0, 0, j, 0))[:total]
        part = shifted * (pos >= j).unsqueeze(-1).to(x.dtype)
        if initial is not None:        # positions before the sequence start read the carried inputs
            seq = torch.searchsorted(cu_seqlens.long()[1:], torch.arange(total, device=x.device), right=True)
            back = pos - j                                 # < 0: -1 is the last carried input
            carried = initial[seq, :, (kernel - 1 + back).clamp(0, kernel - 2)]
            part = part + carried * (back < 0).unsqueeze(-1).to(x.dtype)
        out = out + part * w[:, kernel - 1 - j]
    return F.silu(out)


def stepped(mixer, h: torch.Tensor, attn) -> torch.Tensor | None:
    """A linear layer's mixer (`GatedDeltaNet`, Nemotron-H's `Mamba2Mixer`) over `h` in the engine's step, when the
    attention callable carries one (`attn.linear_states`: `lathe.engine.linear_state.LinearStep`): one token per
    sequence advances the states where they lie (`mixer.step`); else each sequence continues from its own states
    (none given where every sequence starts from zero: `LinearStep.read`), written back after. None when `attn`
    carries no states."""
    states = getattr(attn, "linear_states", None)
    if states is None:
        return None
    if states.max_seqlen == 1:
        return mixer.step(h, states)
    out, new = mixer(h, states.cu_seqlens, states.max_seqlen, states.read())
    states.write(*new)
    return out


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` and `conv_state` of one new token per sequence: x (S, C), `weight` (C, K), `state`
    (S, C, K-1) each sequence's last K-1 inputs, `bias` (C,) or None. Returns (silu(conv) (S, C), the new last K-1
    inputs (S, C, K-1))."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)          # (S, C, K), oldest input first
    conv = (window * weight.to(x.dtype)).sum(-1)
    return F.silu(conv if bias is None else conv + bias.to(x.dtype)), window[..., 1:]


@torch.compiler.disable
def conv_state(x: torch.Tensor, cu_seqlens: torch.Tensor, kernel: int,
               initial: torch.Tensor | None = None) -> torch.Tensor:
    """(S, C, K-1): each sequence's last K-1 inputs (zero-filled, or continued from `initial`, when shorter);
    gathered at once, without a host sync."""
    cu = cu_seqlens.long()
    starts, ends = cu[:-1], cu[1:]
    pos = ends[:, None] - (kernel - 1) + torch.arange(kernel - 1, device=x.device)       # (S, K-1)
    inside = (pos >= starts[:, None]).unsqueeze(-1)
    own = x[pos.clamp(min=0)]                                                              # (S, K-1, C)
    if initial is None:
        earlier = torch.zeros_like(own)
    else:                               # before the sequence's first new token: its carried inputs
        back = (kernel - 1 + pos - starts[:, None]).clamp(0, kernel - 2)
        earlier = initial[torch.arange(len(starts), device=x.device)[:, None], :, back].to(x.dtype)
    return torch.where(inside, own, earlier).transpose(1, 2)


def _to_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, length, ...) rows of a packed (T, ...) tensor, zero-padded at the end, and the (T,) flat row indices."""
    pos = positions_in_sequence(cu_seqlens, x.shape[0])
    seq = torch.searchsorted(cu_seqlens.long()[1:], torch.arange(x.shape[0], device=x.device), right=True)
    index = seq * length + pos
    rows = x.new_zeros(((cu_seqlens.numel() - 1) * length, *x.shape[1:])).index_copy(0, index, x)
    return rows.view(cu_seqlens.numel() - 1, length, *x.shape[1:]), index


def _prepare(q, k, v, g, beta):
    """Float32 (float64 stays) copies, q/k L2-normed with their heads repeated to the value heads, q scaled."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    groups = v.shape[-2] // k.shape[-2]
    q, k = (l2norm(x.to(dtype)).repeat_interleave(groups, dim=-2) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.to(dtype), g.to(dtype), beta.to(dtype)


# The torch form's chunk on CPU: its within-chunk work grows with the chunk (C x C products and a triangular solve
# per chunk) and its loop with the chunk count; on CPU 32 tokens cost less than 64 at the lengths tried, from tens of
# tokens to 2k (and a sequence padded to a whole chunk wastes less). Elsewhere fla's 64.
CPU_CHUNK = 32


@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                           initial_state: torch.Tensor | None = None, chunk_size: int | None = None):
    """(o (T, Hv, Dv) in v's dtype, final states (S, Hv, Dk, Dv) float32) for a packed stream: q, k (T, Hk, Dk)
    before normalisation, v (T, Hv, Dv), g and beta (T, Hv); `initial_state` (S, Hv, Dk, Dv) or zeros. The torch
    form's `chunk_size` (any size gives the same result up to rounding): `CPU_CHUNK` on CPU, else 64."""
    if _fla_runs(q, k, v, g, beta, initial_state, chunked=True):
        return _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state)
    chunk_size = chunk_size or (CPU_CHUNK if q.device.type == "cpu" else 64)
    return _torch_chunk(q, k, v, g, beta, cu_seqlens, max_seqlen, initial_state, chunk_size)


def _torch_chunk(q, k, v, g, beta, cu_seqlens, max_seqlen, initial_state, chunk_size: int = 64):
    """`chunk_gated_delta_rule`'s torch form (the module doc)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    length = -(-max(int(max_seqlen), 1) // chunk_size) * chunk_size
    (q, k, v, g, beta), index = zip(*(_to_rows(x, cu_seqlens, length) for x in (q, k, v, g, beta)))
    index = index[0]
    n, c = length // chunk_size, chunk_size
    # (S, H, chunks, C, D) and (S, H, chunks, C)
    q, k, v = (x.transpose(1, 2).reshape(x.shape[0], x.shape[2], n, c, x.shape[3]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(x.shape[0], x.shape[2], n, c) for x in (g, beta))
    gamma = g.cumsum(-1)
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)                          # gamma_i - gamma_j
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~causal, float("-inf")).exp()                     # 0 above the diagonal
    k_beta = k * beta.unsqueeze(-1)
    a = (k_beta @ k.transpose(-1, -2)) * decay
    a = a.masked_fill(causal.logical_not().logical_or(torch.eye(c, dtype=torch.bool, device=q.device)), 0)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp().unsqueeze(-1)
    k_decayed = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    state = (q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]) if initial_state is None
             else initial_state.to(q.dtype))
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * gamma[:, :, i, -1].exp()[..., None, None] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(q.shape[0], q.shape[1], length, -1).transpose(1, 2)   # (S, L, H, Dv)
    o = o.reshape(-1, *o.shape[2:]).index_select(0, index)
    return o.to(out_dtype), state.float() if state.dtype != torch.float64 else state


@torch.compiler.disable
def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None):
    """Token by token over a batch of rows: q, k (B, L, Hk, Dk), v (B, L, Hv, Dv), g and beta (B, L, Hv), `state`
    (B, Hv, Dk, Dv) or zeros. Returns (o (B, L, Hv, Dv) in v's dtype, the final state)."""
    if _fla_runs(q, k, v, g, beta, state, chunked=False):
        return _fla_recurrent(q, k, v, g, beta, state)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    state = state.to(q.dtype)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        read = (state * k[:, t].unsqueeze(-1)).sum(-2)                             # S^T k
        delta = (v[:, t] - read) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


# ---- flash-linear-attention on CUDA ----------------------------------------------------------------------------


@functools.cache
def fla_ops():
    """fla's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), or None when it does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except ImportError:
        return None
    return chunk, recurrent


@functools.cache
def fla_conv():
    """fla's packed causal convolution (`fla.modules.causal_conv1d.causal_conv1d`), or None when it does not import.
    The torch form here is a dozen eager passes over the (T, C) stream each way (shifted copies, masks, products with
    strided weight columns): in a Qwen3.5-2B update on an H200 the profile's largest non-matmul kernels
    (bench/results/e2e_qwen3.5-2b_no_ckpt_*)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as conv
    except ImportError:
        return None
    return conv


# the last FLA_BOUNDS bounds given, apart under inference mode (True) and outside it (False): (tensor, its version or
# None for an inference tensor, its int64 form), newest last. A prefix-grouped layer hands fla three bounds tensors in
# turn (the prompts', the responses' behind their prompts' convolution inputs, the responses': `GroupedLinear`); fla
# memoises its derivations for up to 4 per function (FLA_TENSOR_CACHE_SIZE's default)
FLA_BOUNDS = 4
_long_bounds: dict[bool, tuple] = {False: (), True: ()}


def fla_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens` as int64 for fla, the same tensor object for the same unchanged input (any of the last
    `FLA_BOUNDS` given). fla memoises what it derives from the bounds (chunk indices, offsets, sequence ids) by the
    identity of the cu_seqlens tensor (`fla.utils.tensor_cache`), and a miss reads the bounds to the host: a sync. A
    fresh `.long()` at every call missed at every layer, four syncs per linear-attention layer and micro-batch in an
    update (the convolution and the delta rule, forward and backward) and eight with gradient checkpointing, each one
    leaving the GPU idle while the host caught up (a Qwen3.5-2B update on an H200 kept its GPU busy 56% of the time
    with checkpointing, bench/results/e2e_qwen3.5-2b_ckpt_profile_nvidia-h200.json). An in-place change of the
    input through torch (its version counter) makes a new int64 tensor; writes the counter does not see (through
    `.data`, numpy, another view of the storage, a CUDA graph's replay) would not, and lathe makes none: its bounds
    are built afresh for each batch (`packing`, `logprob`, `PaddedAttention.row_bounds`,
    `prefix_group.linear_layout`). Under inference mode (the engine's prefills) an inference tensor, which has no
    version counter, is memoised by identity alone, and its int64 form is given only under inference mode (one
    returned outside it would fail a later backward): the engine builds each step's bounds afresh
    (`LinearStateCache.step`) and never writes them, so the linear layers of one step hand fla one tensor, whose
    derivations fla then makes once a step rather than once a layer (as many for six layers as for two: the GPU test
    passed on an H100, bench/results/gpu_tests_hybrid_fresh_24ff103_*).
    Any other tensor under inference mode, or an inference tensor outside it, gets a new int64 tensor at every call."""
    inference = cu_seqlens.is_inference()
    if inference != torch.is_inference_mode_enabled():
        return cu_seqlens.to(torch.long, copy=True)
    entries = _long_bounds[inference]           # one read and one write of the tuple: safe across threads
    now = None if inference else cu_seqlens._version    # (read before the copy: a later write makes the next call miss)
    for given, version, long in entries:
        if given is cu_seqlens and version == now:
            return long
    long = cu_seqlens.to(torch.long, copy=True)
    _long_bounds[inference] = (*[e for e in entries if e[0] is not cu_seqlens][-(FLA_BOUNDS - 1):],
                               (cu_seqlens, now, long))
    return long


def _on_cuda(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _fla_runs(q, *others, chunked: bool) -> bool:
    """Whether fla's kernels take this call: q (..., Hk, Dk), then k, v, g, beta and the initial state (or None).
    Where a gradient is needed: the chunked form where its backward is right here (`_fla_backward_ok`), the
    recurrent form never (fla's recurrent kernel has no backward: the torch form trains through it). Forward-only
    calls: fla's, unless a check found its forward wrong for the layout."""
    if not _on_cuda(q):
        return False
    if fla_ops() is None:
        notice_no_fla()
        return False
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, *others))):
        return _CHECKED.get(_layout(q, others[1], others[3]), (True, True))[0]
    if not chunked:
        return False
    if _fla_backward_ok(q, others[1], others[3]):
        return True
    notice_fla_backward()
    return False


# fla's gated chunk backward on Hopper with Triton 3.4 .. 3.7.0 (fla issue 640): `chunk_bwd_kernel_dqkwg`'s
# transposed product miscompiles there at some key tiles (fla #640's sweep found the 64-wide one; on an H200 with Triton
# 3.6 lathe found the 32-wide one wrong too, the 128-wide one right), and fla refuses the whole backward. Its tile is
# min(next power of two of the key head size, 128) on Hopper. Key heads of 64 or fewer train on the torch form; for
# wider ones (Qwen3.5's and Qwen3-Next's 128) lathe checks each head layout at its first call that needs a gradient
# (`_fla_layout_ok`: output and every gradient of a packed stream against the torch form) and lifts fla's refusal
# where it agrees.
SAFE_KEY_TILE_ABOVE = 64
CHECK_TOLERANCE = 0.1       # norm-relative; bf16 kernels agree to ~1e-2, the miscompiles measured 1.2 (dq), 5.5 (dg)
# the check's stream: near a training micro-batch's shape (~6.7k tokens, 10 sequences: a lone token, one chunk, long
# ones), since the autotuning its calls do picks the configurations training then reuses; no sequence over 1024
# tokens, since the torch form pads every sequence to the longest (~170 MB a float32 tensor at 32 value heads of 128)
CHECK_LENGTHS = (1, 64, 1024, 900, 700, 1000, 512, 1024, 333, 1024)


def _broken_triton(device: torch.device) -> bool:
    """fla refuses its gated chunk backward here (its own version flags; Hopper by this device's capability)."""
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        return False
    return ((nvidia_capability(device) or (0, 0))[0] == 9 and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
            and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))


def _layout(q: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> tuple:
    """What fla's kernels are tuned and compiled for (their autotune keys, dtypes included): lathe hands them q and
    k repeated to the value heads, so the value heads count."""
    return q.device, v.shape[-2], q.shape[-1], v.shape[-1], q.dtype, v.dtype, beta.dtype


def _fla_backward_ok(q: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> bool:
    """Whether fla's gated chunk backward runs for this call's head layout (`lifted_backward_ok`); otherwise training
    takes the torch form (forward-only passes and the engine keep fla's kernels)."""
    layout = _layout(q, v, beta)
    return lifted_backward_ok(q.device, q.shape[-1], layout, lambda: _fla_layout_ok(*layout))


def lifted_backward_ok(device: torch.device, key_dim: int, layout: tuple, check) -> bool:
    """Whether an fla chunk backward that runs the gated `chunk_bwd_dqkwg` (the gated delta rule's; Mamba2's scan,
    `lathe.models.ssd`) runs for a head layout: anywhere but on the broken Tritons; there for key heads wider than
    SAFE_KEY_TILE_ABOVE whose layout passed `check()` ((forward right, backward right), kept in `_CHECKED` by
    `layout`), with the lift of fla's refusal installed."""
    if not _broken_triton(device):
        return True
    if key_dim <= SAFE_KEY_TILE_ABOVE or not _lift_fla_guard():
        return False
    if layout not in _CHECKED:
        if torch._C._current_graph_task_id() != -1:
            return False    # a first grad-enabled call inside a backward (a recompute): its check would wait on it
        _CHECKED[layout] = check()
    return _CHECKED[layout][1]


# a layout (the delta rule's `_layout`, the scan's `ssd._layout`) -> (fla's forward right, its backward right)
_CHECKED: dict[tuple, tuple[bool, bool]] = {}
_LIFT = threading.Lock()    # the version flag is fla's module state: one lifted call at a time, none beside it


@functools.cache
def _lift_fla_guard() -> bool:
    """Wrap the dq/dk/dg kernel's launcher that fla's gated delta rule and simple GLA (Mamba2's scan) backwards call,
    in each module that imported it: for key heads wider than SAFE_KEY_TILE_ABOVE it runs with fla's version flag
    raised for that call only (narrower ones meet fla's own refusal); every call through it holds `_LIFT`. Wraps
    once (a second call finds its own wrapper). False when fla is not laid out as 0.6 is (then the torch form
    trains)."""
    try:
        from fla.ops.common import chunk_o
        from fla.ops.gated_delta_rule import chunk as gated
    except ImportError:
        return False
    callers = [gated]
    try:
        from fla.ops.simple_gla import chunk as simple          # Mamba2's scan (`lathe.models.ssd`)
        callers.append(simple)
    except ImportError:
        pass
    original = getattr(gated, "chunk_bwd_dqkwg", None)
    if original is None or not hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        return False
    if getattr(original, "lathe_lift", False):
        return True

    @functools.wraps(original)
    def dqkwg(*args, **kwargs):
        k = kwargs["k"] if "k" in kwargs else args[1]
        with _LIFT:
            if k.shape[-1] <= SAFE_KEY_TILE_ABOVE:
                return original(*args, **kwargs)
            saved, chunk_o.TRITON_ABOVE_3_7_1 = chunk_o.TRITON_ABOVE_3_7_1, True
            try:
                return original(*args, **kwargs)
            finally:
                chunk_o.TRITON_ABOVE_3_7_1 = saved

    dqkwg.lathe_lift = True
    for module in callers:
        if getattr(module, "chunk_bwd_dqkwg", None) is original:
            module.chunk_bwd_dqkwg = dqkwg
    return True


def _fla_layout_ok(device: torch.device, heads: int, key_dim: int, value_dim: int, q_dtype: torch.dtype,
                   v_dtype: torch.dtype, beta_dtype: torch.dtype) -> tuple[bool, bool]:
    """`checked_layout` of fla's gated delta-rule chunk kernels at this layout (`_layout`). The layout is the
    autotune key of fla's kernels (but for its l2norm kernels, keyed by the stream's rows too: no matrix products,
    outside fla #640), so the configurations chosen here are those training reuses."""
    dtypes = (q_dtype, v_dtype, beta_dtype)
    return checked_layout("gated delta-rule", _layout_text(heads, key_dim, value_dim, *dtypes), device,
                          lambda: _layout_errors(device, heads, key_dim, value_dim, *dtypes))


def _layout_text(heads: int, key_dim: int, value_dim: int, *dtypes: torch.dtype) -> str:
    """A layout (`_layout`, but its device) as the log names it."""
    return f"{heads} value heads of {key_dim}x{value_dim}, {'/'.join(str(d)[6:] for d in dtypes)}"


def checked_layout(what: str, layout: str, device: torch.device, errors) -> tuple[bool, bool]:
    """(forward right, backward right) of fla's `what` kernels at a head layout (`layout`: its text for the log):
    `errors()` gives the norm-relative errors of their output ("o") and of every gradient ("d..."), on a packed
    stream of that layout against the torch form in float32; each must be within CHECK_TOLERANCE. Run in a thread of
    its own, away from the caller's autograd state (a checkpointed forward's saved-tensor hooks, inference mode)."""
    result: dict = {}
    log.info("linear attention: checking fla's %s kernels for %s against the torch form (on a machine where fla "
             "has not run them yet it compiles and autotunes them first: minutes, kept in Triton's cache after)",
             what, layout)
    start = time.perf_counter()

    def check():
        try:
            with use_device(device):
                result["errors"] = errors()
        except Exception as e:          # noqa: BLE001 - a kernel that fails here trains on the torch form
            result["failed"] = e
    thread = threading.Thread(target=check, name="lathe-fla-check")
    thread.start()
    thread.join()
    took = f"{time.perf_counter() - start:.0f} s"
    if "failed" in result:
        log.warning("linear attention: fla's %s kernels failed their check for %s (%r): training takes the torch "
                    "form for it", what, layout, result["failed"])
        return True, False
    errors = result["errors"]
    forward = errors["o"] <= CHECK_TOLERANCE
    backward = forward and all(e <= CHECK_TOLERANCE for e in errors.values())
    shown = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
    if backward:
        log.info("linear attention: fla's %s backward agrees with the torch form for %s (worst sequence: %s; "
                 "checked in %s): it runs past fla's refusal on this Triton (fla issue 640)", what, layout, shown,
                 took)
    else:
        log.warning("linear attention: fla's %s %s disagrees with the torch form for %s (worst sequence: %s; "
                    "tolerance %g): the torch form runs %s for it", what, "forward" if not forward else "backward",
                    layout, shown, CHECK_TOLERANCE, "every pass" if not forward else "training")
    return forward, backward


def _layout_errors(device, heads, key_dim, value_dim, q_dtype, v_dtype, beta_dtype) -> dict[str, float]:
    """The worst sequence's norm-relative error of fla's output and of each gradient against the torch form's, on a
    seeded packed stream of this layout (CHECK_LENGTHS)."""
    gen = torch.Generator().manual_seed(0)
    t = sum(CHECK_LENGTHS)
    host = [torch.randn(t, heads, key_dim, generator=gen), torch.randn(t, heads, key_dim, generator=gen),
            torch.randn(t, heads, value_dim, generator=gen),
            F.logsigmoid(torch.randn(t, heads, generator=gen)) / 4, torch.rand(t, heads, generator=gen).sigmoid()]
    upstream = torch.randn(t, heads, value_dim, generator=gen).to(device)
    bounds = check_bounds()
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    with torch.enable_grad():
        mine = [x.to(device, d).requires_grad_() for x, d in zip(host, (q_dtype, q_dtype, v_dtype, torch.float32,
                                                                         beta_dtype))]
        out, _ = _fla_chunk(*mine, cu, None)
        (out.float() * upstream).sum().backward()
        exact = [x.detach().float().requires_grad_() for x in mine]
        want, _ = _torch_chunk(*exact, cu, max(CHECK_LENGTHS), None)
        (want * upstream).sum().backward()
    return {"o": worst_sequence(out, want, bounds),
            **{f"d{n}": worst_sequence(a.grad, b.grad, bounds) for n, a, b in zip(("q", "k", "v", "g", "beta"),
                                                                                 mine, exact)}}


def check_bounds() -> list[int]:
    """The check stream's sequence bounds (CHECK_LENGTHS)."""
    return [0, *torch.tensor(CHECK_LENGTHS).cumsum(0).tolist()]


def worst_sequence(a: torch.Tensor, b: torch.Tensor, bounds: list[int]) -> float:
    """The largest over the packed sequences of |a - b| over |b|, or over a typical sequence's norm of its size where
    its own is smaller (a lone token's dg is exactly 0: nothing decays yet)."""
    a, b = a.detach().double(), b.detach().double()
    rms = b.norm() / b.numel() ** 0.5
    return max(float((a[i:j] - b[i:j]).norm() / torch.maximum(b[i:j].norm(), rms * b[i:j].numel() ** 0.5)
                     .clamp(min=1e-30)) for i, j in zip(bounds[:-1], bounds[1:]))


@functools.cache
def notice_fla_backward(what: str = "gated delta-rule") -> None:
    log.warning("linear attention: fla's %s backward is wrong on Hopper GPUs with Triton 3.4 .. 3.7.0 (fla issue "
                "640) at key heads of 64 or fewer, and runs at wider ones only where a check against the torch form "
                "passes: this model trains on the torch form (slower). Triton >= 3.7.1 lifts this", what)


# fla's kernels run for the first time in this process at each key of `first_use`: a line when that takes longer
# than this many seconds (Triton compiling and autotuning them)
FIRST_USE_NOTICE_S = 20.0
_used: set = set()


class _Mark(torch.autograd.Function):
    """The identity, calling `then()` when its gradient passes (a watch's start or end of a backward)."""

    @staticmethod
    def forward(ctx, x, then):
        ctx.then = then
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.then()
        return grad, None


class _Watch:
    """The first forward (and backward) of fla's `what` kernels at one key: while one runs longer than
    FIRST_USE_NOTICE_S a line says fla is compiling them (it would look like a hang: on a machine where they have not
    run, Triton compiles and autotunes each kernel's configurations, minutes in all), and a second how long it
    took."""

    def __init__(self, what: str, layout: str):
        self.what, self.layout = what, layout
        self.timer: threading.Timer | None = None

    def start(self, phase: str) -> None:
        self.started, self.noticed = time.perf_counter(), False
        self.timer = threading.Timer(FIRST_USE_NOTICE_S, self._notice, (phase,))
        self.timer.daemon = True
        self.timer.start()

    def _notice(self, phase: str) -> None:
        self.noticed = True
        log.info("linear attention: fla is compiling and autotuning its %s %s kernels for %s (their first use on this "
                 "machine: minutes; Triton's cache keeps them for later runs)", self.what, phase, self.layout)

    def stop(self, phase: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            if self.noticed:
                log.info("linear attention: fla's %s %s kernels for %s are ready (%.0f s)", self.what, phase,
                         self.layout, time.perf_counter() - self.started)


def watched(watch: _Watch | None, call, x: torch.Tensor) -> tuple:
    """`call(x)` (fla's kernels; it returns (output, *rest)), through `watch` where `first_use` gave one: the forward
    watched while it runs, and where a gradient flows, the backward from the output's gradient to x's (two identity
    marks, on a first call only)."""
    if watch is None:
        return call(x)
    watch.start("forward")
    try:
        out, *rest = call(_Mark.apply(x, lambda: watch.stop("backward")) if x.requires_grad else x)
    finally:
        watch.stop("forward")
    return (_Mark.apply(out, lambda: watch.start("backward")) if out.requires_grad else out, *rest)


def variant_text(layout: str, initial_state: torch.Tensor | None) -> str:
    """A first use's layout text with the kernels' variant where it has one: fla compiles its kernels apart for
    calls from given states (the engine's prefill of a prompt's later chunk or a parked turn's continuation; a
    prefix-grouped response) and from zero states (a training or log-prob forward, the engine's prefill of fresh
    sequences), each variant with its own compile and autotune at its first use (27-38 s each for Nemotron-3-Nano's
    scan forward on an H100); two lines that read the same would look like one compile done twice."""
    return layout if initial_state is None else f"{layout}, from given states"


def first_use(what: str, key: tuple, layout) -> _Watch | None:
    """A watch (`_Watch`) for the first call of fla's `what` kernels at `key` (what they are compiled and tuned for)
    in this process, or None after it (and under torch.compile's tracing); `layout()` gives its text for the log."""
    if key in _used or torch.compiler.is_compiling():
        return None
    _used.add(key)
    return _Watch(what, layout())


@functools.cache
def notice_no_fla(what: str = "the gated delta rule") -> None:
    log.warning("linear attention: flash-linear-attention is not installed, so %s runs in torch on the GPU (much "
                "slower); install it with `pip install 'lathe[hybrid]'` (or flash-linear-attention)", what)


def _fla_inputs(q, k, v):
    groups = v.shape[-2] // k.shape[-2]
    return q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)


def _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state):
    chunk, _ = fla_ops()
    q, k = _fla_inputs(q, k, v)
    layout = _layout(q, v, beta)
    watch = first_use("gated delta-rule", ("chunk", *layout, initial_state is None, v.requires_grad),
                      lambda: variant_text(_layout_text(*layout[1:]), initial_state))
    o, state = watched(watch, lambda v: chunk(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.unsqueeze(0).float(),
                                              beta=beta.unsqueeze(0), initial_state=initial_state,
                                              output_final_state=True, cu_seqlens=fla_cu_seqlens(cu_seqlens),
                                              use_qk_l2norm_in_kernel=True), v)
    return o[0], state


def _fla_recurrent(q, k, v, g, beta, state):
    _, recurrent = fla_ops()
    q, k = _fla_inputs(q, k, v)
    # by keyword: fla's recurrent takes (q, k, v, g, gk, gv, beta, ...), its chunk (q, k, v, g, beta, ...)
    return recurrent(q, k, v, g=g.float(), beta=beta, initial_state=state, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
