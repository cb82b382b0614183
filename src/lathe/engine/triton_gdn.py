"""The gated delta rule's decode step on the engine's state slots, in place: one Triton launch per linear layer.

A decode step of a hybrid model (Qwen3.5, Qwen3-Next) advances each running sequence's recurrent state by one
token. Through fla's recurrent kernel that took three passes over the states (gather the rows' slots with
`index_select`, the kernel reading them and writing new ones, `index_copy_` back): three times the state traffic, the
largest share of the step (`bench/results/decode_profile_qwen3.5-2b_gather_nvidia-h200.json`: 9.6 of 16.7 ms at
256 rows). Here each program reads its row's slot from the index, updates one block of value columns of one value
head where it lies, and writes the row's output:

    k, q = l2norm(k), l2norm(q) / sqrt(Dk)            (each key head serves Hv / Hk value heads)
    S    = S * exp(g)
    S    = S + k (beta (v - S^T k))^T
    o    = S^T q

in float32, as `lathe.models.linear_attention.recurrent_gated_delta_rule` computes it. The short convolution before
it (`conv_step_`, with Mamba2's bias too) likewise reads each row's last K-1 inputs from its slot and shifts the new
input in, in one launch (in PyTorch: a gather, a cat, a product, a sum over K and a scatter, 1.9 ms of that 2B step).
Rows that share a slot (a decode graph's padding rows, all at the scratch slot) race there; nothing reads the scratch
slot. Mamba2's scan step: `lathe.engine.triton_ssd`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the PyTorch form runs
    triton = None


if triton is not None:
    @triton.jit
    def _gdn_step_kernel(Q, K, V, G, BETA, O, S, INDEX, stride_q, stride_k, stride_v, scale,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
        row = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // (HV // HK)
        slot = tl.load(INDEX + row).to(tl.int64)
        dk = tl.arange(0, BK)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        mk, mv = dk < DK, dv < DV
        q = tl.load(Q + row * stride_q + hk * DK + dk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + row * stride_k + hk * DK + dk, mask=mk, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(V + row * stride_v + hv * DV + dv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(G + row * HV + hv).to(tl.float32)
        beta = tl.load(BETA + row * HV + hv).to(tl.float32)
        at = S + ((slot * HV + hv) * DK + dk[:, None]) * DV + dv[None, :]
        m = mk[:, None] & mv[None, :]
        h = tl.load(at, mask=m, other=0.0) * tl.exp(g)
        u = beta * (v - tl.sum(h * k[:, None], 0))
        h += k[:, None] * u[None, :]
        tl.store(O + (row * HV + hv) * DV + dv, tl.sum(h * q[:, None], 0).to(O.dtype.element_ty), mask=mv)
        tl.store(at, h, mask=m)


    @triton.jit
    def _conv_step_kernel(X, W, BIAS, STATE, OUT, INDEX, stride_x, C, K: tl.constexpr, KP: tl.constexpr,
                          BC: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(INDEX + row).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        j = tl.arange(0, KP)
        mc = c < C
        carried = mc[:, None] & (j[None, :] < K - 1)
        at = STATE + (slot * C + c[:, None]) * (K - 1) + j[None, :]
        x = tl.load(X + row * stride_x + c, mask=mc, other=0.0)
        window = tl.load(at, mask=carried, other=0.0)                     # (BC, KP): oldest input first
        window = tl.where(j[None, :] == K - 1, x[:, None].to(window.dtype), window)
        w = tl.load(W + c[:, None] * K + j[None, :], mask=mc[:, None] & (j[None, :] < K), other=0.0)
        acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), 1)
        if HAS_BIAS:
            acc += tl.load(BIAS + c, mask=mc, other=0.0).to(tl.float32)
        tl.store(OUT + row * C + c, (acc / (1.0 + tl.exp(-acc))).to(OUT.dtype.element_ty), mask=mc)
        # the window moves on by one: input j + 1 becomes carried input j
        shifted = tl.load(at + 1, mask=mc[:, None] & (j[None, :] < K - 2), other=0.0)
        tl.debug_barrier()
        shifted = tl.where(j[None, :] == K - 2, x[:, None].to(shifted.dtype), shifted)
        tl.store(at, shifted, mask=carried)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def float32_states(states: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless `states` is (slots, *shape) float32 and contiguous, as the in-place step kernels address it."""
    if states.dtype != torch.float32 or not states.is_contiguous() or tuple(states.shape[1:]) != shape:
        raise ValueError(f"states {tuple(states.shape)} {states.dtype}: expected contiguous float32 "
                         f"(slots, {', '.join(map(str, shape))})")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (B, heads, D) with heads and features packed in each row (any row stride): as is, else a copy."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def gated_delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, index: torch.Tensor, block_v: int = 32) -> torch.Tensor:
    """One token per row: q, k (B, Hk, Dk) before normalisation, v (B, Hv, Dv), g and beta (B, Hv); `states`
    (slots, Hv, Dk, Dv) float32, contiguous, row i's state at `states[index[i]]`, updated in place. Returns o
    (B, Hv, Dv) in v's dtype."""
    rows, hk, dk = q.shape
    hv, dv = v.shape[1:]
    float32_states(states, (hv, dk, dv))
    q, k, v = _rows(q), _rows(k), _rows(v)
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(rows, hv, dv, dtype=v.dtype, device=v.device)
    bv = min(block_v, triton.next_power_of_2(dv))
    grid = (rows, hv, triton.cdiv(dv, bv))
    _gdn_step_kernel[grid](q, k, v, g, beta, o, states, index, q.stride(0), k.stride(0), v.stride(0), dk ** -0.5,
                           HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
                           num_warps=4 if bv * dk >= 4096 else 1)
    return o


def conv_step_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, index: torch.Tensor,
               bias: torch.Tensor | None = None, block_c: int = 256) -> torch.Tensor:
    """silu(depthwise causal conv + `bias` (C,) or none) of one new input per row, x (B, C) (any row stride),
    `weight` (C, K), after the last K-1 inputs in `states[index[i]]` ((slots, C, K-1), contiguous), which move on by
    one in place. Returns (B, C) in x's dtype (the products and the bias summed in float32)."""
    rows, channels = x.shape
    kernel = weight.shape[-1]
    if not states.is_contiguous() or states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"states {tuple(states.shape)}: expected contiguous (slots, {channels}, {kernel - 1})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    grid = (rows, triton.cdiv(channels, block_c))
    weight = weight.contiguous()
    _conv_step_kernel[grid](x, weight, weight if bias is None else bias.contiguous(), states, out, index, x.stride(0),
                            channels, K=kernel, KP=triton.next_power_of_2(kernel), BC=block_c,
                            HAS_BIAS=bias is not None, num_warps=4)
    return out
