"""Mamba2's selective state-space scan (Dao and Gu, "Transformers are SSMs", 2024: state-space duality), the token
mixer of Nemotron-H's Mamba layers (`lathe.models.nemotron_h`; the engine's states: `lathe.engine.linear_state`).
Torch forms, which run on every device (not yet: fla's `chunk_simple_gla` on CUDA, which takes the same scan with
q = C, k = B, v = dt x, g = dt A, scale 1).

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

import torch

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
    (module doc)."""
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
