"""Writing new tokens' K and V into the paged cache in one Triton launch per layer.

`KVCache.store_unchecked` on CUDA: one program per token copies its K row and its V row (kv_heads x head_dim
each) to its slot. PyTorch's `index_copy_` takes two launches per tensor (four per layer, a hundred a decode step of
a mid-sized model). No host syncs: CUDA-graph safe.

`rope_store_kv` does a decode step's RoPE in the same launch: one program per token rotates its q heads (written
out for the attention kernel) and its k heads, and stores the rotated k and v at its slot. Three launches a layer
become one (the compiled layer rotated q and k in two kernels before the store).

Into an FP8 cache (`kv_cache`'s module doc) both store each head's values divided by its scale, max|x| / 448 of the
head's row in float32 (after RoPE for k), and the scale beside them: `kv_cache.quantize`'s arithmetic.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FP8_MAX = 448.0         # the largest float8_e4m3fn value


if triton is not None:
    @triton.jit
    def _fp8_row_scales(x1, x2):
        """Per-row (axis 1) scales of a head's values given as two float32 halves (either may be all zeros):
        max|x| x (1 / 448), at least 1e-12 / 448: a product, as `kv_cache.quantize` computes it (PyTorch divides a
        CUDA tensor by a scalar as a product by its reciprocal); the values' division rounds as IEEE's (`div_rn`:
        Triton's `/` is approximate), so the bytes equal the PyTorch path's."""
        amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        return tl.maximum(amax, 1e-12) * (1.0 / 448.0)

    @triton.jit
    def _fp8_values(x, scale, dtype: tl.constexpr):
        """x (rows, cols) float32 / its rows' scales (rows,), clamped to e4m3's range, in `dtype` (`div_rn` does not
        broadcast: the scales are broadcast first)."""
        return tl.clamp(tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)), -448.0, 448.0).to(dtype)

    @triton.jit
    def _store_fp8_halves(x1, x2, C, S, slot, H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, ok):
        """Store a token's heads, given as float32 halves (H_PAD, HALF_PAD) of width HALF, at C (the cache at the
        token's slot and each head's row, offset by the columns) and their scales at S + slot * H + head. HALF = 0:
        x1 is the whole row and x2 zeros, which are not stored."""
        scale = _fp8_row_scales(x1, x2)
        tl.store(C, _fp8_values(x1, scale, C.dtype.element_ty), mask=ok)
        if HALF > 0:
            tl.store(C + HALF, _fp8_values(x2, scale, C.dtype.element_ty), mask=ok)
        heads = tl.arange(0, H_PAD)
        tl.store(S + slot * H + heads, scale, mask=heads < H)

    @triton.jit(do_not_specialize=["stride_k", "stride_v"])
    def _store_fp8_kernel(K, V, KC, VC, KS, VS, SLOTS, stride_k, stride_v, H: tl.constexpr, D: tl.constexpr,
                          H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        """`_store_kernel` into an FP8 cache: a row (H_PAD, D_PAD) per head, its scale beside it (module doc)."""
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        ok = (h < H) & (d < D)
        k = tl.load(K + t.to(tl.int64) * stride_k + h * D + d, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(V + t.to(tl.int64) * stride_v + h * D + d, mask=ok, other=0.0).to(tl.float32)
        zero = tl.zeros([H_PAD, D_PAD], tl.float32)          # the whole row as the first "half" (HALF = 0)
        _store_fp8_halves(k, zero, KC + slot * (H * D) + h * D + d, KS, slot, H, H_PAD, 0, ok)
        _store_fp8_halves(v, zero, VC + slot * (H * D) + h * D + d, VS, slot, H, H_PAD, 0, ok)

    @triton.jit(do_not_specialize=["stride_k", "stride_v"])     # varies between calls: one compile serves all
    def _store_kernel(K, V, KC, VC, SLOTS, stride_k, stride_v, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        k = tl.load(K + t.to(tl.int64) * stride_k + offs, mask=ok)
        v = tl.load(V + t.to(tl.int64) * stride_v + offs, mask=ok)
        tl.store(KC + slot * N + offs, k.to(KC.dtype.element_ty), mask=ok)
        tl.store(VC + slot * N + offs, v.to(VC.dtype.element_ty), mask=ok)


def can_store(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `store_kv` takes these (T, kv_heads, head_dim) tensors: CUDA, Triton, each token's row contiguous."""
    if triton is None or not k.is_cuda:
        return False
    n = k.shape[1] * k.shape[2]
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.shape[1] * t.shape[2] == n for t in (k, v))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """k, v (T, kv_heads, head_dim) -> the caches (num_blocks, block_size, kv_heads, head_dim) at `slots` (T,);
    into an FP8 cache with `scales` = its (k_scale, v_scale), each (num_blocks, block_size, kv_heads) float32."""
    t, n = k.shape[0], k.shape[1] * k.shape[2]
    if t == 0:
        return
    if scales is not None:
        hkv, dim = k.shape[1], k.shape[2]
        _store_fp8_kernel[(t,)](k, v, k_cache, v_cache, scales[0], scales[1], slots, k.stride(0), v.stride(0),
                                H=hkv, D=dim, H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(dim),
                                num_warps=1 if n <= 256 else 2)
        return
    _store_kernel[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), N=n,
                        BLOCK=triton.next_power_of_2(n), num_warps=1 if n <= 256 else 2)


if triton is not None:
    @triton.jit
    def _rotate(X, COS, SIN, heads, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                stride_h):
        """(H_PAD, 2, HALF_PAD) halves of `heads` rows of head_dim = 2 * HALF at X (row stride `stride_h`), rotated:
        x * cos + rotate_half(x) * sin in float32, as the compiled layer computes it."""
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, HALF_PAD)[None, :]
        ok = (h < heads) & (d < HALF)
        x1 = tl.load(X + h * stride_h + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(X + h * stride_h + HALF + d, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(COS + d, mask=d < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(COS + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + d, mask=d < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, h, d, ok

    @triton.jit(do_not_specialize=["stride_qt", "stride_kt", "stride_vt", "stride_cos"])
    def _rope_store_kernel(Q, K, V, COS, SIN, QO, KC, VC, KS, VS, SLOTS, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_vt, stride_vh, stride_cos, HQ: tl.constexpr, HKV: tl.constexpr,
                           HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF: tl.constexpr,
                           HALF_PAD: tl.constexpr, FP8: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cos, sin = COS + t * stride_cos, SIN + t * stride_cos
        o1, o2, h, d, ok = _rotate(Q + t * stride_qt, cos, sin, HQ, HQ_PAD, HALF, HALF_PAD, stride_qh)
        qo = QO + t * (HQ * 2 * HALF) + h * (2 * HALF) + d
        tl.store(qo, o1.to(QO.dtype.element_ty), mask=ok)
        tl.store(qo + HALF, o2.to(QO.dtype.element_ty), mask=ok)
        slot = tl.load(SLOTS + t).to(tl.int64)
        k1, k2, h, d, ok = _rotate(K + t * stride_kt, cos, sin, HKV, HKV_PAD, HALF, HALF_PAD, stride_kh)
        kc = KC + slot * (HKV * 2 * HALF) + h * (2 * HALF) + d
        vc = VC + slot * (HKV * 2 * HALF) + h * (2 * HALF) + d
        v = V + t * stride_vt + h * stride_vh + d
        if FP8:             # each head's values over its scale, the scales beside them (module doc)
            v1 = tl.load(v, mask=ok, other=0.0).to(tl.float32)
            v2 = tl.load(v + HALF, mask=ok, other=0.0).to(tl.float32)
            _store_fp8_halves(k1, k2, kc, KS, slot, HKV, HKV_PAD, HALF, ok)
            _store_fp8_halves(v1, v2, vc, VS, slot, HKV, HKV_PAD, HALF, ok)
        else:
            tl.store(kc, k1.to(KC.dtype.element_ty), mask=ok)
            tl.store(kc + HALF, k2.to(KC.dtype.element_ty), mask=ok)
            tl.store(vc, tl.load(v, mask=ok).to(VC.dtype.element_ty), mask=ok)
            tl.store(vc + HALF, tl.load(v + HALF, mask=ok).to(VC.dtype.element_ty), mask=ok)


def can_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_store_kv` takes these: CUDA, Triton, an even head_dim, each head's row contiguous, cos and sin
    (T, head_dim) alike with contiguous rows."""
    if triton is None or not q.is_cuda or q.shape[-1] % 2 or cos.dim() != 2 or cos.shape[-1] != q.shape[-1]:
        return False
    return all(t.stride(-1) == 1 for t in (q, k, v, cos)) and sin.shape == cos.shape and sin.stride() == cos.stride()


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q (T, Hq, D), k and v (T, Hkv, D) as the projections leave them (any token and head strides), cos/sin (T, D):
    rotate q and k by RoPE (`lathe.models.rope.apply_rotary`'s formula), store the rotated k and v into the
    contiguous caches (num_blocks, block_size, Hkv, D) at `slots` (T,) (an FP8 cache's with `scales`, as `store_kv`
    takes them); return the rotated q, (T, Hq, D) contiguous."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    out = torch.empty(t, hq, dim, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    half = dim // 2
    ks, vs = scales if scales is not None else (k_cache, v_cache)          # unused without FP8
    _rope_store_kernel[(t,)](q, k, v, cos, sin, out, k_cache, v_cache, ks, vs, slots, q.stride(0), q.stride(1),
                             k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), HQ=hq, HKV=hkv,
                             HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=triton.next_power_of_2(hkv), HALF=half,
                             HALF_PAD=triton.next_power_of_2(half), FP8=scales is not None,
                             num_warps=4 if hq * dim >= 2048 else 2)
    return out
