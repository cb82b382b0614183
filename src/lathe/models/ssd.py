"""Mamba2's selective state-space scan (Dao and Gu, "Transformers are SSMs", 2024: state-space duality), the token
mixer of Nemotron-H's Mamba layers (`lathe.models.nemotron_h`; the engine's states: `lathe.engine.linear_state`).
Torch forms, which run on every device and are the reference; on CUDA, when `fla` imports (lathe's `hybrid` extra),
`chunk_scan` runs fla's `chunk_simple_gla` instead, forward and backward: the same scan with q = C and k = B (each
group's repeated to its heads), v = dt x, g = dt A, scale 1 and the state stored (P, N). On Hopper with Triton 3.4 ..
3.7.0, where fla refuses that backward (fla #640), it trains past the refusal for state sizes above 64 once a check of
the layout against the torch form passes, as the gated delta rule does (`lathe.models.linear_attention`).

Per head h (H heads of P channels, `n_groups` groups of B and C of N features; head h reads group h // (H / G)), a
state S (P, N) runs over the tokens of one sequence, from zero or a given state:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D_h x_t

with dt_t > 0 the step (already through softplus and its clamp: the caller's) and A_h < 0.

- `chunk_scan`: the chunked (quadratic within a chunk, linear across chunks) form over a packed stream of sequences
  (`cu_seqlens`): with gamma the chunk's cumulative log decay (dt A),
  y = causal((C_i . B_j) exp(gamma_i - gamma_j)) (dt x) + exp(gamma) C S_prev, and
  S <- exp(gamma_last) S + sum_j exp(gamma_last - gamma_j) dt_j x_j B_j^T. Sequences lie as rows of one padded batch,
  so each starts from its own state; padded steps have dt = 0 and change nothing.
- `scan_step`: one new token per sequence (a decode step).

States are (S, H, P, N) in float32, the layout transformers' Mamba2 cache keeps.
"""

from __future__ import annotations

import functools

import torch

from lathe.models import linear_attention as la
from lathe.models.linear_attention import _to_rows


def heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C (..., G, N) repeated to (..., H, N): head h reads group h // (H / G)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


@torch.compiler.disable
def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               cu_seqlens: torch.Tensor, max_seqlen: int, *, D: torch.Tensor | None = None,
               initial_state: torch.Tensor | None = None, chunk_size: int = 64):
    """y (T, H, P) in x's dtype and the final states (S, H, P, N) float32 (float64 stays) of the packed stream x
    (T, H, P) with steps dt (T, H), A (H,), B and C (T, G, N), D (H,) or None; `initial_state` (S, H, P, N) or zeros
    (module doc). fla's kernels on CUDA where they take the call (`_fla_takes`)."""
    if _fla_takes(x, dt, A, B, C, initial_state):
        return _fla_scan(x, dt, A, B, C, cu_seqlens, D, initial_state)
    return torch_scan(x, dt, A, B, C, cu_seqlens, max_seqlen, D=D, initial_state=initial_state, chunk_size=chunk_size)


def torch_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               cu_seqlens: torch.Tensor, max_seqlen: int, *, D: torch.Tensor | None = None,
               initial_state: torch.Tensor | None = None, chunk_size: int = 64):
    """`chunk_scan`'s torch form (module doc)."""
    out_dtype, heads = x.dtype, x.shape[1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    q, k = (heads_of_groups(t.to(dtype), heads) for t in (C, B))
    v = x.to(dtype) * dt.to(dtype).unsqueeze(-1)
    g = dt.to(dtype) * A.to(dtype)
    length = -(-max(int(max_seqlen), 1) // chunk_size) * chunk_size
    (q, k, v, g), index = zip(*(_to_rows(t, cu_seqlens, length) for t in (q, k, v, g)))
    index = index[0]
    n, c = length // chunk_size, chunk_size
    q, k, v = (t.transpose(1, 2).reshape(t.shape[0], heads, n, c, t.shape[3]) for t in (q, k, v))   # (S,H,n,c,·)
    gamma = g.transpose(1, 2).reshape(g.shape[0], heads, n, c).cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    within = ((q @ k.transpose(-1, -2)) * decay) @ v                              # (S, H, n, c, P)
    q_decayed = q * gamma.exp().unsqueeze(-1)
    k_decayed = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    state = (q.new_zeros(q.shape[0], heads, v.shape[-1], q.shape[-1]) if initial_state is None
             else initial_state.to(dtype))                                        # (S, H, P, N)
    outs = []
    for i in range(n):
        outs.append(within[:, :, i] + q_decayed[:, :, i] @ state.transpose(-1, -2))
        state = state * gamma[:, :, i, -1].exp()[..., None, None] + v[:, :, i].transpose(-1, -2) @ k_decayed[:, :, i]
    y = torch.stack(outs, dim=2).reshape(q.shape[0], heads, length, -1).transpose(1, 2)      # (S, L, H, P)
    y = y.reshape(-1, *y.shape[2:]).index_select(0, index)
    if D is not None:
        y = y + x.to(dtype) * D.to(dtype).unsqueeze(-1)
    return y.to(out_dtype), state if state.dtype == torch.float64 else state.float()


@functools.cache
def fla_scan():
    """fla's `chunk_simple_gla`, or None when it does not import."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


WHAT = "Mamba2 scan (simple GLA)"


def _layout(x: torch.Tensor, B: torch.Tensor, dt: torch.Tensor) -> tuple:
    """What fla's kernels are tuned and compiled for at this call: heads, state size, head size, dtypes."""
    return "mamba2", x.device, x.shape[1], B.shape[-1], x.shape[-1], x.dtype, dt.dtype


def _fla_takes(x, dt, A, B, C, initial_state) -> bool:
    """Whether fla's kernels run this scan: on CUDA where fla imports (not float64); where a gradient is needed,
    where its backward is right here (`linear_attention.lifted_backward_ok`, the layout checked by `_layout_ok`);
    forward-only calls unless that check found fla's forward wrong for the layout."""
    if not la._on_cuda(x) or x.dtype == torch.float64:
        return False
    if fla_scan() is None:
        la.notice_no_fla("Mamba2's scan")
        return False
    layout = _layout(x, B, dt)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (x, dt, A, B, C, initial_state))):
        return la._CHECKED.get(layout, (True, True))[0]
    if la.lifted_backward_ok(x.device, B.shape[-1], layout, lambda: _layout_ok(*layout[1:])):
        return True
    la.notice_fla_backward(WHAT)
    return False


def _fla_scan(x, dt, A, B, C, cu_seqlens, D, initial_state):
    """`chunk_scan` by fla's `chunk_simple_gla` (module doc): q, k and v in x's dtype, the decay and the state in
    float32."""
    heads = x.shape[1]
    q, k = (heads_of_groups(t.to(x.dtype), heads) for t in (C, B))
    v = (x.float() * dt.float().unsqueeze(-1)).to(x.dtype)
    g = dt.float() * A.float()
    layout = _layout(x, B, dt)
    watch = la.first_use(WHAT, (*layout, initial_state is None, v.requires_grad),
                         lambda: la.variant_text(_layout_text(*layout[2:6]), initial_state))
    o, state = la.watched(watch, lambda v: fla_scan()(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), scale=1.0,
        initial_state=None if initial_state is None else initial_state.float(), output_final_state=True,
        state_v_first=True, cu_seqlens=la.fla_cu_seqlens(cu_seqlens)), v)
    y = o[0].float()
    if D is not None:
        y = y + x.float() * D.float().unsqueeze(-1)
    return y.to(x.dtype), state.float()


def _layout_ok(device: torch.device, heads: int, state: int, head_dim: int, x_dtype: torch.dtype,
               dt_dtype: torch.dtype) -> tuple[bool, bool]:
    """`linear_attention.checked_layout` of fla's scan at this layout (`_layout`)."""
    return la.checked_layout(WHAT, _layout_text(heads, state, head_dim, x_dtype), device,
                             lambda: _layout_errors(device, heads, state, head_dim, x_dtype, dt_dtype))


def _layout_text(heads: int, state: int, head_dim: int, x_dtype: torch.dtype) -> str:
    """A layout (`_layout`) as the log names it."""
    return f"{heads} heads of {head_dim} with states of {state}, {str(x_dtype)[6:]}"


def _layout_errors(device, heads, state, head_dim, x_dtype, dt_dtype) -> dict[str, float]:
    """fla's output and gradients (x, B, C, dt per sequence; A, the heads' decay rates, as a whole) against the
    torch form's in float32, on a seeded packed stream of this layout (linear_attention.CHECK_LENGTHS), one group
    per head (the kernels see B and C repeated to the heads either way)."""
    gen = torch.Generator().manual_seed(0)
    bounds = la.check_bounds()
    t = bounds[-1]
    host = {"x": torch.randn(t, heads, head_dim, generator=gen),
            "dt": torch.nn.functional.softplus(torch.randn(t, heads, generator=gen) - 2),
            "A": -(torch.rand(heads, generator=gen) * 4 + 0.5),
            "B": torch.randn(t, heads, state, generator=gen) / state ** 0.5,
            "C": torch.randn(t, heads, state, generator=gen) / state ** 0.5}
    upstream = torch.randn(t, heads, head_dim, generator=gen).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    dtypes = {"x": x_dtype, "dt": dt_dtype, "A": torch.float32, "B": x_dtype, "C": x_dtype}
    with torch.enable_grad():
        mine = {n: h.to(device, dtypes[n]).requires_grad_() for n, h in host.items()}
        exact = {n: h.detach().float().requires_grad_() for n, h in mine.items()}
        out = _fla_scan(*mine.values(), cu, None, None)[0]
        (out.float() * upstream).sum().backward()
        want = torch_scan(*exact.values(), cu, max(la.CHECK_LENGTHS))[0]
        (want * upstream).sum().backward()
    errors = {"o": la.worst_sequence(out, want, bounds)}
    errors.update((f"d{n}", la.worst_sequence(mine[n].grad, exact[n].grad, bounds)) for n in ("x", "dt", "B", "C"))
    a, b = mine["A"].grad.double(), exact["A"].grad.double()
    return {**errors, "dA": float((a - b).norm() / b.norm().clamp(min=1e-30))}


def scan_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              state: torch.Tensor, *, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence: x (S, H, P), dt (S, H), B and C (S, G, N), `state` (S, H, P, N). Returns (y (S, H,
    P) in x's dtype, the advanced state in `state`'s dtype). No host sync: a CUDA graph can capture it."""
    heads, dtype = x.shape[1], torch.promote_types(state.dtype, torch.float32)
    b, c = (heads_of_groups(t.to(dtype), heads) for t in (B, C))
    step = dt.to(dtype)
    new = (state.to(dtype) * (step * A.to(dtype)).exp()[..., None, None]
           + (x.to(dtype) * step.unsqueeze(-1)).unsqueeze(-1) * b.unsqueeze(-2))
    y = (new * c.unsqueeze(-2)).sum(-1)
    if D is not None:
        y = y + x.to(dtype) * D.to(dtype).unsqueeze(-1)
    return y.to(x.dtype), new.to(state.dtype)
