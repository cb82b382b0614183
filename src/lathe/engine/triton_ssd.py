"""Mamba2's decode step on the engine's state slots, in place: one Triton launch per Mamba2 layer (Nemotron-H).

A decode step advances each running sequence's scan state (H, P, N) float32 by one token. In PyTorch
(`lathe.models.ssd.scan_step` on states gathered with `index_select`, written back with `index_copy_`) that is about
eleven passes over the states: the gather, the decay, the outer-product add, the read-out product and its sum, the
scatter. At Nemotron-3-Nano's layout a state is 2 MiB a sequence and layer, 512 MiB a layer at 256 rows, so those
passes, not the projections, would pace the decode. Here each program reads one block of P rows of one head's state
from its row's slot, and writes it back once:

    S = S * exp(dt A) + (dt x) B^T,        y = S C + D x

in float32, as `scan_step` computes it (head h reads B and C of group h // (H / G)). Rows that share a slot (a decode
graph's padding rows, all at the scratch slot) race there; nothing reads the scratch slot.
"""

from __future__ import annotations

import torch

from lathe.engine.triton_gdn import _rows, available, float32_states, triton

__all__ = ["available", "scan_step_"]

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _scan_step_kernel(X, DT, A, B, C, D, Y, S, INDEX, stride_x, stride_b, stride_c,
                          H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                          BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        g = h // (H // G)
        slot = tl.load(INDEX + row).to(tl.int64)
        p = tl.program_id(2) * BP + tl.arange(0, BP)
        n = tl.arange(0, BN)
        mp, mn = p < P, n < N
        x = tl.load(X + row * stride_x + h * P + p, mask=mp, other=0.0).to(tl.float32)
        b = tl.load(B + row * stride_b + g * N + n, mask=mn, other=0.0).to(tl.float32)
        c = tl.load(C + row * stride_c + g * N + n, mask=mn, other=0.0).to(tl.float32)
        dt = tl.load(DT + row * H + h).to(tl.float32)
        a = tl.load(A + h).to(tl.float32)
        at = S + ((slot * H + h) * P + p[:, None]) * N + n[None, :]
        m = mp[:, None] & mn[None, :]
        state = tl.load(at, mask=m, other=0.0) * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], 1)
        if HAS_D:
            y += tl.load(D + h).to(tl.float32) * x
        tl.store(Y + (row * H + h) * P + p, y.to(Y.dtype.element_ty), mask=mp)
        tl.store(at, state, mask=m)


def scan_step_(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor | None, states: torch.Tensor, index: torch.Tensor, block_p: int = 32) -> torch.Tensor:
    """One token per row: x (R, H, P), dt (R, H) (after softplus and its clamp), A (H,), B and C (R, G, N), D (H,) or
    None (x, B and C may be views with a wider row stride); `states` (slots, H, P, N) float32, contiguous, row i's
    state at `states[index[i]]`, advanced in place. Returns y (R, H, P) in x's dtype."""
    rows, heads, head_dim = x.shape
    groups, size = B.shape[1:]
    float32_states(states, (heads, head_dim, size))
    x, B, C = _rows(x), _rows(B), _rows(C)
    dt, A = dt.float().contiguous(), A.float().contiguous()
    y = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
    bp = min(block_p, triton.next_power_of_2(head_dim))
    bn = triton.next_power_of_2(size)
    grid = (rows, heads, triton.cdiv(head_dim, bp))
    _scan_step_kernel[grid](x, dt, A, B, C, A if D is None else D.float().contiguous(), y, states, index,
                            x.stride(0), B.stride(0), C.stride(0), H=heads, G=groups, P=head_dim, N=size, BP=bp,
                            BN=bn, HAS_D=D is not None, num_warps=4 if bp * bn >= 2048 else 1)
    return y
