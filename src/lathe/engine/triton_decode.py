"""Paged decode attention in Triton: one new query token per sequence over its KV blocks.

One program handles one sequence, one KV head and one split of the context: it loads the query
heads that share that KV head (GQA, padded to 16 rows for `tl.dot`), walks the context in tiles of
`BLOCK_N` tokens, reading each token's slot through the block table, and keeps an online softmax.
With several splits (short batches, long contexts) each split writes its unnormalised partial result
and the split that finishes last for its (sequence, KV head), told by a counter, merges them in split order in
the same launch (flash-decoding without a second kernel). The caller picks `num_splits` once per batch shape,
so the launch is CUDA-graph safe: nothing here reads a tensor on the host.

GPT-OSS's layers: a sliding `window` starts each sequence's walk at its first position inside the window (the splits
share what is left), and `sinks` (a logit per query head) join the softmax's denominator once, where the output is
normalised (the last split's merge when there are several).

An FP8 cache (`kv_cache`'s module doc; `scales` = its per-token, per-head float32 scales): each tile's K and V load
as e4m3, convert exactly to q's dtype, and their scales multiply the tile's scores (K) and probabilities (V) in
float32 before the products: q . (s_k k) = s_k (q . k) and sum p s_v v = sum (p s_v) v. In float16 V's tile takes its
scales instead (s_v v, as `paged_attention` dequantises): p s_v of a small V row (scales of 1e-6 and less) would lie
in float16's subnormals, which keep a few bits of a probability or none. The step's own token (`new_kv`) is
quantised as `triton_store` quantises it. V's tile is read as 16-bit words (e4m3 pairs) and widened in registers:
an 8-bit tile, the P.V product's transposed operand, would be read from shared memory a byte at a time (sm_90 has no
8-bit transposing ldmatrix; 0.55x the bf16 kernel at 32 x 8448 tokens against 0.75x this way, bench/results'
kv_fp8_decode_variants_ab). That needs an even head_dim and even cache strides. The FP8 kernel pipelines 2 tiles
ahead, not 3: 126 registers a thread in place of 154 (sm_90, Triton 3.6) keep 4 programs an SM, not 3, so a batch of
512 (sequence, KV head) programs runs in one wave (bench/results' kv_fp8_decode_tiles_ab: 1.5B heads, 256 x 512 tokens
46.8 us, bf16 cache 47.3; 3 stages 65.9; the byte-read form at 411f121 60.4, which held 216 registers, 2 programs).

`paged_decode` is the public entry; `lathe.engine.paged_attention.decode_attention` is the PyTorch
reference it must match (tests run this kernel in Triton's interpreter on CPU).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from lathe.device import nvidia_capability

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the PyTorch reference path is used
    triton = None


# the least tokens a context split takes (`paged_decode`'s `min_split`): with `choose_num_splits`'s wider splits for
# narrow tiles, a context up to ~1.3k tokens in a bucket of 32 rows uses about the splits the old rule gave it. On an
# H200 (`rollout_minsplit_ab_*_nvidia-h200.json`): 256 beat 0 and the old rule on GRPO-like lengths at 0.5B and 1.5B
# (tokens per decode second 58.2k / 55.2k / 43.3k at 0.5B) and on 32 x 8192 tokens (-5% to -6% of the seconds)
SPLIT_MIN_TOKENS = 256


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, as the tests use it)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:
    @triton.jit
    def _softmax_tile(scores, n_ok, m_i, l_i):
        """One tile of the online softmax: the tile's probabilities on the new running max (masked positions 0),
        the old sums' rescale factor, the new sum and max."""
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        return p, alpha, l_i * alpha + tl.sum(p, 1), m_new

    @triton.jit
    def _kv_tile(table, start_n, end, h, d, d_ok, stride_kblock, stride_ktok, stride_kh, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
        """A tile of BLOCK_N context positions from `start_n` (those before `end`), read through a sequence's block
        table `table`: (positions, which are in range, their blocks, KV head h's element offsets, the load mask)."""
        n = start_n + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(table + n // PAGE, mask=n_ok, other=0)
        tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok
        return n, n_ok, block, tok[:, None] + h * stride_kh + d[None, :], n_ok[:, None] & d_ok[None, :]

    @triton.jit(do_not_specialize=["stride_bt", "stride_kn", "stride_vn", "stride_cos"])   # vary: one compile
    def _decode_kernel(Q, K, V, KS, VS, BT, LENS, O, M, L, OUT, COUNT, KN, VN, COS, SIN, SLOTS, SINKS, PLEN, window,
                       min_split,
                       stride_qb, stride_qh, stride_kblock, stride_ktok, stride_kh, stride_bt,
                       stride_ob, stride_os, stride_oh, stride_mb, stride_ms, stride_outb, stride_outh,
                       stride_kn, stride_knh, stride_vn, stride_vnh, stride_cos, stride_sblock, stride_stok,
                       scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       NEW_KV: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
                       PREFIX_SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(LENS + b)
        first = tl.maximum(ctx - window, 0)             # the window's first position (0 without a window)
        if PREFIX_SPLITS > 0:       # the shared prefix [0, plen) was attended by `_prefix_kernel` (its partials merge)
            plen = tl.load(PLEN + b)
            first = tl.maximum(first, plen)
            pre_ok = (tl.arange(0, GROUP_PAD) < GROUP) & (tl.arange(0, GROUP_PAD) * 0 + plen > 0)
        per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        if NUM_SPLITS > 1:      # at least `min_split` tokens a split: a short context uses the first `used` splits
            per_split = tl.maximum(per_split, tl.maximum(min_split, BLOCK_N))
        used = tl.maximum(tl.cdiv(ctx - first, per_split), 1) if NUM_SPLITS > 1 else 1
        start = first + s * per_split
        end = tl.minimum(start + per_split, ctx)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        if NEW_KV:
            d_rot = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
            sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
            cos = tl.load(COS + b * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
            sin = tl.load(SIN + b * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
            slot = tl.load(SLOTS + b).to(tl.int64)
        if PDL:
            # Launched as a programmatic dependent of the launch before it (`paged_decode(pdl=True)`): the program
            # may start while that one drains. Above this line it reads only the lengths, RoPE rows and slots, which
            # that launch must not write; q, the token's k/v, the cache and every write come after the wait, which
            # returns once the previous launch has completed and its writes are visible.
            tl.extra.cuda.gdc_wait()
        q_ptr = Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if NEW_KV:
            # q arrives before RoPE: x * cos + rotate_half(x) * sin in float32 (rotate_half(x) = [-x2, x1]),
            # rounded to q's dtype as the store's launch wrote it. The token's own K/V (the context's last
            # position) come from KN/VN: the split that holds it rotates and stores them at their slot, and after a
            # CTA barrier (its threads' stores visible to its threads' loads) the loop reads them back from the cache
            # like every other position: the same arithmetic, in the same order, as a store launch followed by the
            # plain kernel. No other program reads that slot (the sequence's own block; other splits stop short).
            # Adding the token to the softmax from registers instead cost layout conversions and CTA barriers
            # before the loop (9 barriers against 4 in Triton 3.9's PTX at head_dim 128) and, kept for after the
            # loop, more registers a thread and a load's latency at the
            # end of every program.
            q_rot = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d_rot[None, :],
                            mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_rot * sin[None, :]).to(Q.dtype.element_ty)
            last = ctx - 1 + 0 * d                          # the token's position, as a vector for the masks
            new_ok = d_ok & (start <= last) & (last < end)
            k_row = KN + b * stride_kn + h * stride_knh
            k_new = tl.load(k_row + d, mask=new_ok, other=0.0).to(tl.float32)
            k_rot = tl.load(k_row + d_rot, mask=new_ok, other=0.0).to(tl.float32)
            k_new = k_new * cos + sign * k_rot * sin
            v_new = tl.load(VN + b * stride_vn + h * stride_vnh + d, mask=new_ok, other=0.0)
            at = (slot // PAGE) * stride_kblock + (slot % PAGE) * stride_ktok + h * stride_kh + d
            if KV_FP8:      # max|x| / 448 over the head's row (masked lanes load 0), as `triton_store` quantises
                s_at = (slot // PAGE) * stride_sblock + (slot % PAGE) * stride_stok + h
                ours = (start <= ctx - 1) & (ctx - 1 < end)
                v_new = v_new.to(tl.float32)
                k_new_s = tl.maximum(tl.max(tl.abs(k_new), 0), 1e-12) * (1.0 / 448.0)
                v_new_s = tl.maximum(tl.max(tl.abs(v_new), 0), 1e-12) * (1.0 / 448.0)
                k_new = tl.clamp(tl.div_rn(k_new, tl.broadcast_to(k_new_s, k_new.shape)), -448.0, 448.0)
                v_new = tl.clamp(tl.div_rn(v_new, tl.broadcast_to(v_new_s, v_new.shape)), -448.0, 448.0)
                tl.store(KS + s_at, k_new_s, mask=ours)
                tl.store(VS + s_at, v_new_s, mask=ours)
            tl.store(K + at, k_new.to(K.dtype.element_ty), mask=new_ok)
            tl.store(V + at, v_new.to(V.dtype.element_ty), mask=new_ok)
            tl.debug_barrier()

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            n, n_ok, block, kv_off, kv_mask = _kv_tile(BT + b * stride_bt, start_n, end, h, d, d_ok, stride_kblock,
                                                       stride_ktok, stride_kh, PAGE, BLOCK_N)
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:      # e4m3 -> q's dtype is exact; the scales multiply the scores (module doc)
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
                scores = tl.dot(q, tl.trans(k.to(Q.dtype.element_ty))).to(tl.float32) * (k_s * scale)[None, :]
            else:
                scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            p, alpha, l_i, m_new = _softmax_tile(scores, n_ok, m_i, l_i)
            if KV_FP8:      # V's e4m3 pairs read as 16-bit words and widened in registers (module doc)
                half = tl.arange(0, DIM_PAD // 2)
                tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok + h * stride_kh
                w = tl.load(V.to(tl.pointer_type(tl.uint16)) + (tok[:, None] // 2 + half[None, :]),
                            mask=n_ok[:, None] & (half < HEAD_DIM // 2)[None, :], other=0)
                lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)
                hi = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)
                v = tl.reshape(tl.join(lo, hi), [BLOCK_N, DIM_PAD])
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
                if Q.dtype.element_ty == tl.float16:    # p x s_v would fall into float16's subnormals: scale V
                    pv = tl.dot(p.to(tl.float16), (v.to(tl.float32) * v_s[:, None]).to(tl.float16))
                else:
                    pv = tl.dot((p * v_s[None, :]).to(Q.dtype.element_ty), v)
            else:
                v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new

        if HAS_SINKS:
            sink = tl.load(SINKS + h * GROUP + g, mask=g_ok, other=0.0).to(tl.float32)
        o_ptr = O + b * stride_ob + s * stride_os + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
        if NUM_SPLITS == 1:
            if PREFIX_SPLITS > 0:    # the prefix kernel's partials (slots 1..PREFIX_SPLITS), when this row has one
                for t in tl.static_range(PREFIX_SPLITS):
                    at_ml = b * stride_mb + (1 + t) * stride_ms + h * GROUP + g
                    m_t = tl.load(M + at_ml, mask=pre_ok, other=float("-inf"))
                    m_new = tl.maximum(m_i, m_t)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    a_own, a_t = tl.exp(m_i - m_safe), tl.exp(m_t - m_safe)
                    l_i = l_i * a_own + a_t * tl.load(L + at_ml, mask=pre_ok, other=0.0)
                    o_t = tl.load(O + b * stride_ob + (1 + t) * stride_os + (h * GROUP + g)[:, None] * stride_oh
                                  + d[None, :], mask=pre_ok[:, None] & d_ok[None, :], other=0.0)
                    acc = acc * a_own[:, None] + a_t[:, None] * o_t
                    m_i = m_new
            if HAS_SINKS:        # the sink's exp(sink) joins the denominator, on the running max's scale
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.exp(m_i - m_fin)
                l_i = l_i * alpha + tl.exp(sink - m_fin)
                acc = acc * alpha[:, None]
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            if PREFIX_SPLITS > 0:    # O holds the partials; the output goes to OUT
                tl.store(OUT + b * stride_outb + (h * GROUP + g)[:, None] * stride_outh + d[None, :],
                         out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
            else:
                tl.store(o_ptr, out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        elif s < used:      # a split past the context's `used` ones read nothing: it writes nothing, nor counts
            tl.store(o_ptr, acc, mask=g_ok[:, None] & d_ok[None, :])
            ml = b * stride_mb + s * stride_ms + h * GROUP + g
            tl.store(M + ml, m_i, mask=g_ok)
            tl.store(L + ml, l_i, mask=g_ok)
            # The split that finishes last of the used ones for this (sequence, KV head) merges them, in split order
            # (deterministic), then the prefix kernel's partials; the counter goes back to zero for the next layer or
            # graph replay.
            tl.debug_barrier()
            done = tl.atomic_add(COUNT + b * tl.num_programs(1) + h, 1, sem="acq_rel")
            if done == used - 1:
                m_row = M + b * stride_mb + h * GROUP + g
                m_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                for t in range(used):
                    m_max = tl.maximum(m_max, tl.load(m_row + t * stride_ms, mask=g_ok, other=float("-inf"),
                                                      cache_modifier=".cg"))
                for t in tl.static_range(PREFIX_SPLITS):
                    m_max = tl.maximum(m_max, tl.load(m_row + (NUM_SPLITS + t) * stride_ms, mask=pre_ok,
                                                      other=float("-inf"), cache_modifier=".cg"))
                if HAS_SINKS:
                    m_max = tl.maximum(m_max, sink)
                m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                num = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
                den = tl.zeros([GROUP_PAD], tl.float32)
                if HAS_SINKS:
                    den += tl.exp(sink - m_max)
                o_row = O + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
                l_row = L + b * stride_mb + h * GROUP + g
                for t in range(used):
                    w = tl.exp(tl.load(m_row + t * stride_ms, mask=g_ok, other=float("-inf"),
                                       cache_modifier=".cg") - m_max)
                    den += w * tl.load(l_row + t * stride_ms, mask=g_ok, other=0.0, cache_modifier=".cg")
                    num += w[:, None] * tl.load(o_row + t * stride_os, mask=g_ok[:, None] & d_ok[None, :],
                                                other=0.0, cache_modifier=".cg")
                for t in tl.static_range(PREFIX_SPLITS):
                    pre_at = NUM_SPLITS + t
                    w = tl.exp(tl.load(m_row + pre_at * stride_ms, mask=pre_ok, other=float("-inf"),
                                       cache_modifier=".cg") - m_max)
                    den += w * tl.load(l_row + pre_at * stride_ms, mask=pre_ok, other=0.0, cache_modifier=".cg")
                    num += w[:, None] * tl.load(o_row + pre_at * stride_os, mask=pre_ok[:, None] & d_ok[None, :],
                                                other=0.0, cache_modifier=".cg")
                out = num / tl.maximum(den, 1.1754943508222875e-38)[:, None]
                out_ptr = OUT + b * stride_outb + (h * GROUP + g)[:, None] * stride_outh + d[None, :]
                tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
                tl.atomic_xchg(COUNT + b * tl.num_programs(1) + h, 0)


    @triton.jit(do_not_specialize=["stride_bt", "stride_cos"])
    def _prefix_kernel(Q, K, V, BT, GROUPS, O, M, L, COS, SIN,
                       stride_qb, stride_qh, stride_kblock, stride_ktok, stride_kh, stride_bt,
                       stride_ob, stride_os, stride_oh, stride_mb, stride_ms, stride_cos,
                       scale, GROUP: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FIRST_SLOT: tl.constexpr,
                       PREFIX_SPLITS: tl.constexpr, ROTATE: tl.constexpr):
        """One program per (group, KV head, prefix split): the query heads of all the group's rows that share that KV
        head, as one tile of rows x GROUP query rows, against the prefix the group's rows share (their block tables
        agree over it), each K/V tile read once for the group. Writes each row's unnormalised partial (acc, max,
        sum) at split slot FIRST_SLOT + split, which `_decode_kernel` merges (`paged_decode`'s `prefix`)."""
        gi = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        row0 = tl.load(GROUPS + gi * 3)
        rows = tl.load(GROUPS + gi * 3 + 1)
        plen = tl.load(GROUPS + gi * 3 + 2)
        per_split = tl.cdiv(tl.cdiv(plen, PREFIX_SPLITS), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, plen)
        i = tl.arange(0, ROWS_PAD)
        d = tl.arange(0, DIM_PAD)
        r = i // GROUP
        head = h * GROUP + i % GROUP
        i_ok = r < rows
        d_ok = d < HEAD_DIM
        row = (row0 + tl.where(i_ok, r, 0)).to(tl.int64)
        q_ok = i_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + row[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
        if ROTATE:      # q before RoPE, rotated as `_decode_kernel` rotates it (module doc)
            d_rot = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
            sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
            cos = tl.load(COS + row[:, None] * stride_cos + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
            sin = tl.load(SIN + row[:, None] * stride_cos + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
            q_rot = tl.load(Q + row[:, None] * stride_qb + head[:, None] * stride_qh + d_rot[None, :], mask=q_ok,
                            other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos + sign[None, :] * q_rot * sin).to(Q.dtype.element_ty)
        m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, DIM_PAD], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            n, n_ok, block, kv_off, kv_mask = _kv_tile(BT + row0.to(tl.int64) * stride_bt, start_n, end, h, d, d_ok,
                                                       stride_kblock, stride_ktok, stride_kh, PAGE, BLOCK_N)
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            p, alpha, l_i, m_new = _softmax_tile(scores, n_ok, m_i, l_i)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        slot = FIRST_SLOT + s
        tl.store(O + row[:, None] * stride_ob + slot * stride_os + head[:, None] * stride_oh + d[None, :], acc,
                 mask=q_ok)
        ml = row * stride_mb + slot * stride_ms + head
        tl.store(M + ml, m_i, mask=i_ok)
        tl.store(L + ml, l_i, mask=i_ok)


@dataclass(frozen=True)
class SharedPrefix:
    """Rows of a decode batch that share a prefix of their block tables (`shared_prefixes`), for `paged_decode`."""
    groups: torch.Tensor        # (G, 3) int32 on the device: first row, rows (0: an unused entry), prefix length
    lens: torch.Tensor          # (B,) int32: each row's shared prefix length (0: none)
    splits: int                 # programs per (group, KV head) over the prefix
    max_rows: int               # the most rows a group holds


def shared_prefixes(tables, lens, page: int, *, max_rows: int = 8, min_tokens: int = 512,
                    capacity: int | None = None) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """Groups of consecutive rows whose block tables agree over their first blocks (one physical copy of a prompt's
    KV, as the block manager shares it between the `n` samples of a prompt): [(first row, rows, prefix length)] and
    each row's prefix length (int32, 0 outside the groups). A group's prefix stops at its first differing block and
    before each row's last position (the token the step writes, in a block of the row's own); a run of more than
    `max_rows` rows is cut into groups of `max_rows` (each reads the prefix once), and prefixes shorter than
    `min_tokens` are left to the rows. `tables` (B, W) and `lens` (B,) numpy arrays (or what converts to them);
    `capacity` pads the list with unused entries (rows 0)."""
    tables, lens = np.asarray(tables), np.asarray(lens)
    rows = len(lens)
    groups, plens = [], np.zeros(rows, dtype=np.int32)
    if rows >= 2:
        first = tables[:rows, 0]
        cut = np.flatnonzero(first[1:] != first[:-1]) + 1
        for lo, hi in zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [rows]]).tolist()):
            for b in range(lo, hi, max_rows):
                e = min(b + max_rows, hi)
                shortest = int(lens[b:e].min())
                width = min(-(-(shortest - 1) // page), tables.shape[1])    # blocks before the last position
                if e - b < 2 or min(width * page, shortest - 1) < min_tokens:
                    continue
                differ = (tables[b + 1:e, :width] != tables[b, :width]).any(0)
                plen = min((int(differ.argmax()) if differ.any() else width) * page, shortest - 1)
                if plen >= min_tokens:
                    groups.append((b, e - b, plen))
                    plens[b:e] = plen
    if capacity is not None:
        if len(groups) > capacity:
            raise ValueError(f"shared_prefixes: {len(groups)} groups do not fit a capacity of {capacity}")
        groups += [(0, 0, 0)] * (capacity - len(groups))
    return groups, plens


def prefix_splits(groups: list[tuple[int, int, int]], num_kv_heads: int, head_dim: int, num_sms: int,
                  max_splits: int = 4) -> int:
    """Programs per (group, KV head) over the shared prefixes: about one per SM over all groups at head_dim 128 (two
    at 64, whose tiles are half the bytes), a power of two up to `max_splits` (each is a graph of its own); 0 without
    groups. On an H200 (`bench/results/decode_shared_prefix_*`) the best at 32 groups of 8 rows: 4 for 0.5B's two
    KV heads of 64, 2 for 1.5B's two of 128, 1 for 7B's four of 128 at prompts up to 1024 (2 at 2048, by 5%)."""
    used = sum(1 for g in groups if g[1])
    if not used:
        return 0
    want = max(1, min(round(num_sms * 128 / (head_dim * used * num_kv_heads)), max_splits))
    return 1 << (want.bit_length() - 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float | None = None, num_splits: int = 1,
                 block_n: int = 64, num_warps: int = 4, num_stages: int | None = None,
                 counters: torch.Tensor | None = None, new_kv: tuple | None = None, pdl: bool = False,
                 sinks: torch.Tensor | None = None, window: int | None = None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 prefix: SharedPrefix | None = None, min_split: int | None = None) -> torch.Tensor:
    """q (B, Hq, D); k/v_cache (num_blocks, block_size, Hkv, D), any strides with the last dimension contiguous (a
    head-major cache passes as a permuted view); k and v strided alike; block_tables (B, max_blocks) int32/int64;
    context_lens (B,) >= 1. Returns (B, Hq, D) in q's dtype. Same contract as the PyTorch reference.
    With several splits, `counters` is int32 scratch of at least B * Hkv zeros (left at zero; a decode step's
    layers share one): the last split of each (sequence, KV head) merges the others in the same launch.

    `new_kv = (k, v, cos, sin, slots)`: the step's own token, which the same launch rotates and stores (what
    `triton_store.rope_store_kv` and a plain call did in two launches): q (B, Hq, D) and k (B, Hkv, D) arrive before
    RoPE, cos/sin (B, D) rows, v (B, Hkv, D) (rows contiguous, any token and head strides), slots (B,) where its K/V
    go (the context's last position; a padding row's scratch slot). The launch then attends over the whole context
    from the cache, the token's K/V read back after a barrier within the program.

    `pdl`: launch as a programmatic dependent of the launch before it (Hopper and newer, `pdl_available`), so that the
    programs start while that one drains: only for a caller whose previous launch does not write context_lens or
    new_kv's cos/sin/slots (the decode step: the q/k/v projection writes q, k and v only).

    `sinks` (Hq,): a logit per query head in each softmax's denominator; `window`: the sliding window (a query sees
    itself and the window - 1 positions before it); both as `decode_attention` takes them (GPT-OSS).

    `scales` = (k_scale, v_scale), each (num_blocks, block_size, Hkv) float32 with the caches' leading strides in
    elements of their own: an FP8 cache's (module doc).

    `prefix` (`SharedPrefix`, from `shared_prefixes`): groups of consecutive rows whose block tables agree over a
    prefix (the `n` samples of a prompt): a first launch attends each group's query heads over its prefix together,
    reading each K/V tile once for the group, and this kernel attends each row over the rest and merges. Ignored with a
    sliding `window` or an FP8 cache.

    `min_split` (`SPLIT_MIN_TOKENS` when None): with several splits, each split takes at least this many tokens of
    the context (and at least one tile), so a short context uses only the first splits it fills; the others write
    nothing and the merge reads only the used ones. The launch stays the same for every context (graph-safe)."""
    if triton is None:
        raise RuntimeError("paged_decode needs Triton; install triton or use the 'torch' decode backend")
    min_split = SPLIT_MIN_TOKENS if min_split is None else min_split
    if min_split < 0:
        raise ValueError(f"paged_decode: min_split must be >= 0 tokens, got {min_split}")
    if num_stages is None:      # an FP8 cache: 2 stages keep 4 programs an SM (module doc)
        num_stages = 3 if scales is None else 2
    B, hq, dim = q.shape
    _, page, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"paged_decode: {hq} query heads is not a multiple of {hkv} KV heads")
    if k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_decode: k/v caches need a contiguous last dimension and the same strides")
    group = hq // hkv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(B, hq, dim, dtype=q.dtype, device=q.device)
    if new_kv is None:
        kn = vn = cos = sin = slots = q                                  # unused
        nb = (0, 0, 0, 0, 0)
    else:
        kn, vn, cos, sin, slots = new_kv
        if dim % 2 or kn.stride(-1) != 1 or vn.stride(-1) != 1 or cos.stride(-1) != 1 \
                or sin.stride() != cos.stride() or cos.shape[-1] != dim:
            raise ValueError("paged_decode: new_kv needs an even head_dim, k and v rows contiguous, and cos/sin "
                             "(B, head_dim) rows alike")
        nb = (kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos.stride(0))
    if prefix is not None and (window is not None or scales is not None or prefix.splits == 0):
        prefix = None
    psplits = 0 if prefix is None else prefix.splits
    if num_splits == 1 and prefix is None:
        o, m, l, count = out.unsqueeze(1), out, out, out              # m/l/count unused with one split
        sm = (0, 0)
    else:
        o = torch.empty(B, num_splits + psplits, hq, dim, device=q.device, dtype=torch.float32)
        m = torch.empty(B, num_splits + psplits, hq, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        sm = (m.stride(0), m.stride(1))
        if num_splits == 1:
            count = out                                                 # unused with one split
        else:
            count = counters if counters is not None else torch.zeros(B * hkv, dtype=torch.int32, device=q.device)
        if num_splits > 1 and (count.numel() < B * hkv or count.dtype != torch.int32):
            raise ValueError(f"paged_decode: counters must be int32 with at least {B * hkv} elements")
    ks, vs = scales if scales is not None else (k_cache, v_cache)        # unused without FP8
    if scales is not None and (ks.stride() != vs.stride() or ks.stride(2) != 1):
        raise ValueError("paged_decode: k/v scales need the same strides and a contiguous head dimension")
    if scales is not None and (dim % 2 or any(st % 2 for st in v_cache.stride()[:3]) or v_cache.data_ptr() % 2):
        raise ValueError("paged_decode: an FP8 cache needs an even head_dim and even strides (V is read in 16-bit "
                         f"words), got head_dim {dim}, strides {tuple(v_cache.stride())}")
    if sinks is not None and (sinks.shape != (hq,) or sinks.stride(0) != 1):
        raise ValueError(f"paged_decode: sinks must be ({hq},) and contiguous, got {tuple(sinks.shape)}")
    if prefix is not None:
        groups = prefix.groups
        _prefix_kernel[(groups.shape[0], hkv, psplits)](
            q, k_cache, v_cache, block_tables, groups, o, m, l, cos, sin,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            o.stride(0), o.stride(1), o.stride(2), *sm, nb[4], scale,
            GROUP=group, ROWS_PAD=max(16, triton.next_power_of_2(prefix.max_rows * group)), HEAD_DIM=dim,
            DIM_PAD=max(16, triton.next_power_of_2(dim)), PAGE=page, BLOCK_N=block_n, FIRST_SLOT=num_splits,
            PREFIX_SPLITS=psplits, ROTATE=new_kv is not None, num_warps=num_warps, num_stages=num_stages)
    _decode_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, o, m, l, out, count, kn, vn, cos, sin, slots,
        q if sinks is None else sinks, context_lens if prefix is None else prefix.lens, window or (1 << 30),
        min_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        o.stride(0), o.stride(1), o.stride(2), *sm, out.stride(0), out.stride(1), *nb,
        ks.stride(0) if scales is not None else 0, ks.stride(1) if scales is not None else 0, scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        DIM_PAD=max(16, triton.next_power_of_2(dim)), PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        NEW_KV=new_kv is not None, PDL=pdl, HAS_SINKS=sinks is not None, KV_FP8=scales is not None,
        PREFIX_SPLITS=psplits, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}))
    return out


def pdl_available(device: torch.device) -> bool:
    """Whether `paged_decode(pdl=True)` can run on `device`: an NVIDIA GPU of compute capability 9.0 or newer, a Triton
    with programmatic dependent launch, and not Triton's CPU interpreter."""
    return (triton is not None and device.type == "cuda" and not interpreted()
            and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")
            and (nvidia_capability(device) or (0,))[0] >= 9)


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16, *, head_dim: int = 128,
                      fp8: bool = False) -> int:
    """Splits of each row's context so that enough programs keep the SMs reading; only a small batch is split.
    A program reads tiles of 64 tokens x head_dim values of K and V: at head_dim 128 in bf16, programs for about
    twice the SMs do (rounded up); a tile of half the bytes (head_dim 64 or less, or an FP8 cache, whose kernel is
    also slower a tile) wants about four an SM, the most that fit at once, rounded to the nearest count, so a batch
    that fills the SMs on its own stays whole. On an H200, 32 rows of 8448 tokens: 1.5B's heads over an FP8 cache
    5 -> 8 splits, 0.5B's (head_dim 64) over bf16 5 -> 8 (`bench/kv_fp8_decode.py --splits`,
    `kv_decode_splits*_ab_nvidia-h200.json`)."""
    programs = batch * num_kv_heads
    if fp8 or head_dim <= 64:
        return max(1, min(max_splits, round(4 * num_sms / programs)))
    return max(1, min(max_splits, (2 * num_sms + programs - 1) // programs))
