"""Fused sampling in Triton: temperature sampling or greedy, plus the chosen token's log-prob, in two small kernels.

The PyTorch sampler (`sampler.sample`) makes about ten passes over the (B, V) logits (cast, scale, softmax,
cumsum, log_softmax, ...). Here each row is cut into chunks of `CHUNK` tokens:

1. `_chunk_kernel`, one program per (row, chunk): the chunk's max, its first argmax, and the sum of
   exp((x - chunk max) / T). All chunks of all rows run at once: one pass over the logits at full bandwidth
   (one program per row, walking a whole vocabulary three times, is several times slower).
2. `_pick_kernel`, one program per row: the row's max and greedy argmax from the chunks', the total
   sum = sum over chunks of sum_c * exp((max_c - max) / T), and for a sampled row the draw: the chunk where the
   running sum first passes `u * total`, then the token inside it where it does. The same inverse-CDF draw, from
   the same uniform `u`, as the PyTorch path (up to float summation order). The log-prob is
   `x/T - max/T - log(total)`, T = 1 for greedy rows.

The uniform is computed in the kernel from the sequence's seed and output position: splitmix64, bit for bit the
host's `sampler.uniforms`. So the whole sampler takes device tensors only and can run inside a CUDA graph
(`cuda_graph.py` captures it behind the decode forward).

Top-k and top-p (`fused_sample(top_k=, top_p=)`) cut the row at a threshold found without sorting: a radix search
over the logits' order-preserving integer keys (float32 bits, flipped for negatives). Each pass, `_count_kernel`
over all (row, chunk) programs counts the tokens (top-k) or sums their mass (top-p) at or above `SEARCH[...].np` evenly
spaced pivot keys in the row's current bracket, then `_narrow_kernel`, one program per row, keeps the sub-bracket
that holds the threshold: the largest key t with count(x >= t) >= k (top-k), or with mass(x >= t) >= p * mass of the
top-k set (top-p, over the tokens top-k kept). bf16 logits carry 16 significant key bits, so four passes of 16
pivots (4 bits each) find each threshold exactly. Tokens at the threshold's value are all kept: a tie is kept or
dropped whole (`sampler.apply_top_k_top_p`, the PyTorch path, follows the same rule). The last pass's per-chunk
masses at the chosen pivot are the kept mass of each chunk, which `_pick_kernel` draws from as above. The log-prob
stays that of the full distribution at temperature T.

Rows with a min_tokens ban in force use the PyTorch path (`sampler.sample` decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CHUNK = 4096        # tokens of a row per chunk (the searches' sweep, `SEARCH`, was run at this size)
CHUNK_WARPS = 4     # warps of `_chunk_kernel`: measured faster than 8 at reading the logits


@dataclass(frozen=True)
class SearchConfig:
    """How `_count_kernel` runs: `np` pivots per pass (a power of two up to PART_NP: log2(np) key bits per pass),
    `sub` tokens held at once, `warps`."""

    np: int
    sub: int
    warps: int


PART_NP = 16        # per-pivot slots of the search's partial sums: the most pivots a pass may use
# per search: top-k's passes count, top-p's sum mass; each the fastest setting of a sweep on a GPU
SEARCH = {"top_k": SearchConfig(4, 1024, 4), "top_p": SearchConfig(16, 2048, 2)}


if triton is not None:
    @triton.jit
    def _uniform(seed, pos):
        """splitmix64 of `seed * golden + (pos + 1) * c` -> a float in [0, 1) from its top 53 bits (then float32),
        as `sampler.uniforms` computes it in numpy."""
        z = seed.to(tl.uint64) * 0x9E3779B97F4A7C15 + (pos.to(tl.uint64) + 1) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        return ((z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)).to(tl.float32)

    @triton.jit
    def _chunk_kernel(LOGITS, stride, V, TEMP, GREEDY, PM, PS, PA, NCHUNK, CHUNK_: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        greedy = tl.load(GREEDY + row)
        inv_t = tl.where(greedy != 0, 1.0, 1.0 / tl.load(TEMP + row))
        offs = c * CHUNK_ + tl.arange(0, CHUNK_)
        ok = offs < V
        x = tl.load(LOGITS + row.to(tl.int64) * stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        first = tl.min(tl.where(x == m, offs, V), 0)
        s = tl.sum(tl.where(ok, tl.exp((x - m) * inv_t), 0.0), 0)
        out = row * NCHUNK + c
        tl.store(PM + out, m)
        tl.store(PS + out, s)
        tl.store(PA + out, first)

    @triton.jit
    def _order_key(x):
        """float32 -> int32 key with the floats' order (-0.0 counted as +0.0): a negative float's bits, read as an
        int32, grow with its magnitude; flipping the 31 low bits reverses that."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, tl.where(b == -2147483648, 0, b ^ 2147483647))

    @triton.jit
    def _row_totals(PM, PS, row, NCHUNK, inv_t, NCHUNK_PAD: tl.constexpr):
        """(chunk indices, in-range mask, chunk maxima, row max, each chunk's mass relative to the row max)."""
        cs = tl.arange(0, NCHUNK_PAD)
        cok = cs < NCHUNK
        m = tl.load(PM + row * NCHUNK + cs, mask=cok, other=float("-inf"))
        s = tl.load(PS + row * NCHUNK + cs, mask=cok, other=0.0)
        best = tl.max(m, 0)
        return cs, cok, m, best, tl.where(cok, s * tl.exp((m - best) * inv_t), 0.0)

    @triton.jit
    def _prep_kernel(PM, PS, V, TEMP, GREEDY, TOPK, USE_K: tl.constexpr, FLOATS, INTS, B, NCHUNK,
                     NCHUNK_PAD: tl.constexpr):
        """Per row: the max and the full mass (FLOATS rows 0, 1); the search state LO = GATE = the lowest key, J = -1;
        the top-k target k (FLOATS row 2), or -1 where the row does not search."""
        row = tl.program_id(0)
        greedy = tl.load(GREEDY + row)
        inv_t = tl.where(greedy != 0, 1.0, 1.0 / tl.load(TEMP + row))
        cs, cok, m, best, w = _row_totals(PM, PS, row, NCHUNK, inv_t, NCHUNK_PAD)
        target = -1.0
        if USE_K:
            k = tl.load(TOPK + row)
            target = tl.where((greedy == 0) & (k > 0) & (k < V), k.to(tl.float32), -1.0)
        tl.store(FLOATS + row, best)
        tl.store(FLOATS + B + row, tl.sum(w, 0))
        tl.store(FLOATS + 2 * B + row, target)
        tl.store(INTS + row, -2147483648)
        tl.store(INTS + B + row, -2147483648)
        tl.store(INTS + 2 * B + row, -1)

    @triton.jit
    def _count_kernel(LOGITS, stride, V, TEMP, FLOATS, INTS, B, PART, NCHUNK, pivot_stride,
                      CHUNK_: tl.constexpr, SUB_: tl.constexpr, NP_: tl.constexpr, PS_: tl.constexpr,
                      COUNT: tl.constexpr, MASS: tl.constexpr):
        """One (row, chunk): the count (COUNT) and the mass (MASS) of the chunk's tokens at or above each of the NP
        pivots LO + j * pivot_stride (tokens below GATE left out), into PART[row, chunk, 0 / 1, j]."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        if tl.load(FLOATS + 2 * B + row) >= 0:
            best = tl.load(FLOATS + row)
            inv_t = 1.0 / tl.load(TEMP + row)       # searching rows are sampled rows
            gate = tl.load(INTS + B + row)
            pivots = tl.load(INTS + row) + tl.arange(0, NP_) * pivot_stride
            count = tl.zeros([NP_], dtype=tl.float32)
            mass = tl.zeros([NP_], dtype=tl.float32)
            base = LOGITS + row.to(tl.int64) * stride
            for sub in range(0, CHUNK_, SUB_):
                offs = c * CHUNK_ + sub + tl.arange(0, SUB_)
                ok = offs < V
                x = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32)
                key = _order_key(x)
                live = ok & (key >= gate)
                above = key[None, :] >= pivots[:, None]     # (`& live[None, :]` fails Triton 3.6's layout pass)
                if COUNT:
                    count += tl.sum(tl.where(above, live.to(tl.float32)[None, :], 0.0), 1)
                if MASS:
                    e = tl.where(live, tl.exp((x - best) * inv_t), 0.0)
                    mass += tl.sum(tl.where(above, e[None, :], 0.0), 1)
            out = PART + (row * NCHUNK + c) * 2 * PS_ + tl.arange(0, NP_)
            tl.store(out, count)
            tl.store(out + PS_, mass)

    @triton.jit
    def _narrow_kernel(FLOATS, INTS, B, PART, NCHUNK, pivot_stride, BY_MASS: tl.constexpr, NP_: tl.constexpr,
                       PS_: tl.constexpr, NCHUNK_PAD: tl.constexpr):
        """One row: sum the chunks' counts/masses per pivot and move LO to the largest pivot whose count (top-k)
        or mass (top-p) still reaches the target; J = that pivot's index, KEEP (FLOATS row 3) = its mass."""
        row = tl.program_id(0)
        target = tl.load(FLOATS + 2 * B + row)
        if target >= 0:
            cs = tl.arange(0, NCHUNK_PAD)
            js = tl.arange(0, NP_)
            ptr = PART + row * NCHUNK * 2 * PS_ + cs[:, None] * 2 * PS_ + js[None, :]
            live = (cs < NCHUNK)[:, None]
            count = tl.sum(tl.load(ptr, mask=live, other=0.0), 0)
            mass = tl.sum(tl.load(ptr + PS_, mask=live, other=0.0), 0)
            if BY_MASS:
                j = tl.max(tl.where(mass >= target, js, 0), 0)
            else:
                j = tl.max(tl.where(count >= target, js, 0), 0)
            tl.store(INTS + row, tl.load(INTS + row) + j * pivot_stride)
            tl.store(INTS + 2 * B + row, j)
            tl.store(FLOATS + 3 * B + row, tl.sum(tl.where(js == j, mass, 0.0), 0))

    @triton.jit
    def _top_p_kernel(GREEDY, TOPP, FLOATS, INTS, B):
        """Between the searches, per row: top-p searches from the lowest key over the tokens top-k kept (GATE = the
        top-k threshold), for the target p * their mass; rows without top-p stop searching (J, LO stay top-k's)."""
        row = tl.program_id(0)
        p = tl.load(TOPP + row)
        used_k = tl.load(FLOATS + 2 * B + row) >= 0         # the target still holds k for rows top-k searched
        searches = (tl.load(GREEDY + row) == 0) & (p < 1.0)
        kept = tl.where(used_k, tl.load(FLOATS + 3 * B + row), tl.load(FLOATS + B + row))
        tl.store(FLOATS + 2 * B + row, tl.where(searches, p * kept, -1.0))
        if searches:
            tl.store(INTS + B + row, tl.where(used_k, tl.load(INTS + row), -2147483648))
            tl.store(INTS + row, -2147483648)

    @triton.jit(do_not_specialize=["out_stride"])     # varies between calls: one compile serves all
    def _pick_kernel(LOGITS, stride, V, TEMP, GREEDY, SEED, POS, PM, PS, PA, NCHUNK, OUT, out_stride,
                     FLOATS, INTS, B, PART, FILTER: tl.constexpr, PS_: tl.constexpr,
                     CHUNK_: tl.constexpr, NCHUNK_PAD: tl.constexpr):
        row = tl.program_id(0)
        greedy = tl.load(GREEDY + row)
        inv_t = tl.where(greedy != 0, 1.0, 1.0 / tl.load(TEMP + row))
        cs, cok, m, best, w = _row_totals(PM, PS, row, NCHUNK, inv_t, NCHUNK_PAD)
        a = tl.load(PA + row * NCHUNK + cs, mask=cok, other=V)
        token = tl.min(tl.where(m == best, a, V), 0)            # the first index of the row's max
        total = tl.sum(w, 0)
        base = LOGITS + row.to(tl.int64) * stride
        if greedy == 0:
            threshold = tl.full([], -2147483648, dtype=tl.int32)     # the lowest key: every token
            if FILTER:      # a row that searched draws from the chunks' masses at its threshold's pivot
                j = tl.load(INTS + 2 * B + row)
                kept = tl.load(PART + (row * NCHUNK + cs) * 2 * PS_ + PS_ + tl.maximum(j, 0), mask=cok,
                               other=0.0)
                w = tl.where(j >= 0, kept, w)
                threshold = tl.where(j >= 0, tl.maximum(tl.load(INTS + row), tl.load(INTS + B + row)), threshold)
            target = _uniform(tl.load(SEED + row), tl.load(POS + row)) * tl.sum(w, 0)
            cum = tl.cumsum(w, 0)
            last_chunk = tl.max(tl.where(w > 0, cs, 0), 0)
            pick = tl.min(tl.where((cum > target) & cok, cs, NCHUNK_PAD), 0)
            pick = tl.where(pick < NCHUNK_PAD, pick, last_chunk)     # u * total rounded past the last sum
            running = tl.sum(tl.where(cs < pick, w, 0.0), 0)
            offs = pick * CHUNK_ + tl.arange(0, CHUNK_)
            ok = offs < V
            x = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32)
            if FILTER:
                ok = ok & (_order_key(x) >= threshold)
            e = tl.where(ok, tl.exp((x - best) * inv_t), 0.0)
            inside = tl.cumsum(e, 0) + running
            found = tl.min(tl.where((inside > target) & ok, offs, V), 0)
            last_nonzero = tl.max(tl.where(e > 0, offs, 0), 0)
            token = tl.where(found < V, found, last_nonzero)
        x_tok = tl.load(base + token).to(tl.float32)
        tl.store(OUT + row, token.to(tl.float64))
        tl.store(OUT + out_stride + row, ((x_tok - best) * inv_t - tl.log(total)).to(tl.float64))


_KEY_STEP = {torch.bfloat16: 1 << 16, torch.float16: 1 << 13}     # float32 key bits these dtypes leave at zero


def search_strides(dtype: torch.dtype, np: int) -> list[int]:
    """The pivot spacing of each pass of a search with `np` pivots for logits of `dtype`: from 2**32 / np down to at
    most the spacing of neighbouring values (a float32 key's low bits that bf16/fp16 leave zero are skipped).
    Pivots stay inside int32: the bracket starts at -2**31 and is 2**32 wide."""
    strides = [(1 << 32) // np]
    while strides[-1] > _KEY_STEP.get(dtype, 1):
        strides.append(max(1, strides[-1] // np))    # pivots past a bracket narrower than np are never chosen
    return strides


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor, out: torch.Tensor | None = None, chunk: int | None = None,
                 top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """(2, B) float64: row 0 the token ids, row 1 their log-probs, for logits (B, V) of any float dtype.

    temperatures (B,) float32 > 0 (ignored for greedy rows); greedy (B,) int32 0/1; seeds (B,) int64 and
    positions (B,) int64, the sequence's seed and output position that give each sampled row its uniform.
    top_k (B,) int64 (<= 0 or >= V: none) and top_p (B,) float32 (>= 1: none), or None when no row uses it.
    `out`: a (2, >= B) float64 buffer to write into (a CUDA graph's static output). `chunk`: tokens per chunk
    (default `CHUNK`, read at the call). No host syncs."""
    b, v = logits.shape
    chunk = chunk or CHUNK
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    nchunk = triton.cdiv(v, chunk)
    pad = max(16, triton.next_power_of_2(nchunk))
    warps = 8 if chunk >= 2048 else 4
    pm = torch.empty(b, nchunk, dtype=torch.float32, device=logits.device)
    ps = torch.empty_like(pm)
    pa = torch.empty(b, nchunk, dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(2, b, dtype=torch.float64, device=logits.device)
    _chunk_kernel[(b, nchunk)](logits, logits.stride(0), v, temperatures, greedy, pm, ps, pa, nchunk,
                               CHUNK_=chunk, num_warps=CHUNK_WARPS)
    filtered = top_k is not None or top_p is not None
    if filtered:        # the searches' state; without them the pick kernel reads none of it (pm/pa stand in)
        floats = torch.empty(4, b, dtype=torch.float32, device=logits.device)   # max, mass, target, kept mass
        ints = torch.empty(3, b, dtype=torch.int32, device=logits.device)       # LO, GATE, J
        part = torch.empty(b, nchunk, 2, PART_NP, dtype=torch.float32, device=logits.device)
        _search(logits, v, temperatures, greedy, top_k, top_p, pm, ps, nchunk, pad, floats, ints, part, chunk)
    else:
        floats, ints, part = pm, pa, pm
    _pick_kernel[(b,)](logits, logits.stride(0), v, temperatures, greedy, seeds, positions, pm, ps, pa, nchunk,
                       out, out.stride(0), floats, ints, b, part, FILTER=filtered, PS_=PART_NP,
                       CHUNK_=chunk, NCHUNK_PAD=pad, num_warps=warps)
    return out[:, :b]


def _search(logits, v, temperatures, greedy, top_k, top_p, pm, ps, nchunk, pad, floats, ints, part, chunk):
    """The top-k, then the top-p threshold of every searching row (state in `floats`/`ints`, see the kernels)."""
    b = logits.shape[0]
    use_k = top_k is not None
    dummy = ints[0]                       # stands for an absent top_k / top_p: never read
    _prep_kernel[(b,)](pm, ps, v, temperatures, greedy, top_k if use_k else dummy, use_k, floats, ints, b,
                       nchunk, NCHUNK_PAD=pad)
    phases = ([False] if use_k else []) + ([True] if top_p is not None else [])
    for by_mass in phases:
        if by_mass:
            _top_p_kernel[(b,)](greedy, top_p, floats, ints, b)
        cfg = SEARCH["top_p" if by_mass else "top_k"]
        assert cfg.np <= PART_NP
        strides = search_strides(logits.dtype, cfg.np)
        for i, pivot_stride in enumerate(strides):     # top-k counts; its last pass and top-p sum the mass
            _count_kernel[(b, nchunk)](logits, logits.stride(0), v, temperatures, floats, ints, b, part, nchunk,
                                       pivot_stride, CHUNK_=chunk, SUB_=min(cfg.sub, chunk), NP_=cfg.np, PS_=PART_NP,
                                       COUNT=not by_mass, MASS=by_mass or i == len(strides) - 1,
                                       num_warps=cfg.warps)
            _narrow_kernel[(b,)](floats, ints, b, part, nchunk, pivot_stride, BY_MASS=by_mass, NP_=cfg.np, PS_=PART_NP,
                                 NCHUNK_PAD=pad)
