"""Decode-attention kernel variants against lathe's paged kernel, at the engine's shapes: does issuing the next tile's
loads before computing the current one (software prefetch by hand) read the cache faster than Triton's pipeliner?

    python bench/decode_variants.py [--batch 256] [--contexts 256,512,768] [--out bench/results/decode_variants_<device>.json]

Candidates, each at a few tile/launch settings (one split; batch 256 fills the GPU):
- `engine`: `triton_decode.paged_decode` as the engine runs it (block table, K, scores, softmax, then V, with
  Triton's software pipelining over `num_stages`);
- `early_v`: the same loop with V's load issued right after K's (both in flight before the dot);
- `prefetch`: the block ids of tile i+2 and the K/V of tile i+1 are loaded (into registers) while tile i is
  computed: every load has a whole iteration to arrive, whatever the pipeliner does with the indirect address.
Contexts are uniform per run, or `mixed` (uniform in [ctx/2, 3ctx/2], as a decode batch's are). Each: median time
(triton.testing.do_bench), bandwidth (K and V bytes read over time), error against the PyTorch reference in float32.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lathe.engine.paged_attention import decode_attention  # noqa: E402
from lathe.engine.triton_decode import paged_decode  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


@triton.jit
def _online_softmax(q, k, v, n_ok, m_i, l_i, acc, scale):
    """One tile of keys `k` / values `v` (masked by `n_ok`) folded into the running max, sum and output."""
    scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _variant_kernel(Q, K, V, BT, LENS, O, stride_qb, stride_qh, stride_kblock, stride_ktok, stride_kh, stride_bt,
                    stride_ob, stride_oh, scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(LENS + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    q = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = BT + b * stride_bt
    head = h * stride_kh + d[None, :]
    if PREFETCH:
        n0 = tl.arange(0, BLOCK_N)
        ok0 = n0 < ctx
        blk0 = tl.load(bt_row + n0 // PAGE, mask=ok0, other=0)
        off0 = (blk0.to(tl.int64) * stride_kblock + (n0 % PAGE) * stride_ktok)[:, None] + head
        k_nx = tl.load(K + off0, mask=ok0[:, None], other=0.0)
        v_nx = tl.load(V + off0, mask=ok0[:, None], other=0.0)
        n1 = BLOCK_N + tl.arange(0, BLOCK_N)
        blk_nx = tl.load(bt_row + n1 // PAGE, mask=n1 < ctx, other=0)
        for start_n in range(0, ctx, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            n_ok = n < ctx
            k = k_nx
            v = v_nx
            nn = n + BLOCK_N
            nn_ok = nn < ctx
            off = (blk_nx.to(tl.int64) * stride_kblock + (nn % PAGE) * stride_ktok)[:, None] + head
            k_nx = tl.load(K + off, mask=nn_ok[:, None], other=0.0)
            v_nx = tl.load(V + off, mask=nn_ok[:, None], other=0.0)
            n2 = nn + BLOCK_N
            blk_nx = tl.load(bt_row + n2 // PAGE, mask=n2 < ctx, other=0)
            m_i, l_i, acc = _online_softmax(q, k, v, n_ok, m_i, l_i, acc, scale)
    else:                                                        # early V: K and V issued together
        for start_n in range(0, ctx, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            n_ok = n < ctx
            blk = tl.load(bt_row + n // PAGE, mask=n_ok, other=0)
            off = (blk.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok)[:, None] + head
            k = tl.load(K + off, mask=n_ok[:, None], other=0.0)
            v = tl.load(V + off, mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _online_softmax(q, k, v, n_ok, m_i, l_i, acc, scale)
    out = acc / l_i[:, None]
    tl.store(O + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=g_ok[:, None])


def variant_decode(q, kc, vc, tables, lens, *, prefetch: bool, block_n: int, num_warps: int, num_stages: int):
    """Every context >= 1 token (no empty rows: the variants divide by l without a guard); head_dim a power of 2."""
    b, hq, dim = q.shape
    _, page, hkv, _ = kc.shape
    group = hq // hkv
    out = torch.empty_like(q)
    _variant_kernel[(b, hkv)](q, kc, vc, tables, lens, out, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
                              kc.stride(2), tables.stride(0), out.stride(0), out.stride(1), 1.0 / math.sqrt(dim),
                              GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page,
                              BLOCK_N=block_n, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    return out


def candidates():
    for bn, w, st in itertools.product((32, 64), (2, 4), (1, 2, 3)):
        yield "engine", dict(block_n=bn, num_warps=w, num_stages=max(st, 1))
    for bn, w, st in itertools.product((32, 64), (2, 4, 8), (1, 2, 3)):
        yield "early_v", dict(prefetch=False, block_n=bn, num_warps=w, num_stages=st)
    for bn, w in itertools.product((16, 32, 64), (2, 4, 8)):
        yield "prefetch", dict(prefetch=True, block_n=bn, num_warps=w, num_stages=1)


def main() -> None:
    from train import result_header, write_result
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="256,512,768")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {**result_header("decode_variants", device, args, triton=triton.__version__), "shapes": {}}
    g = torch.Generator(device=device).manual_seed(0)
    b, page = args.batch, args.page
    for (shape, (hq, hkv, dim)), ctx, mixed in itertools.product(SHAPES.items(), map(int, args.contexts.split(",")),
                                                                  (False, True)):
        lens = (torch.randint(ctx // 2, ctx * 3 // 2 + 1, (b,), device=device, generator=g) if mixed
                else torch.full((b,), ctx, device=device))
        per = -(-int(lens.max()) // page)
        blocks = b * per + 1
        kc = torch.randn(blocks, page, hkv, dim, device=device, dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        tables = torch.randperm(blocks - 1, device=device, generator=g)[:b * per].view(b, per).int()
        q = torch.randn(b, hq, dim, device=device, dtype=torch.bfloat16, generator=g)
        nbytes = 2 * int(lens.sum()) * hkv * dim * 2
        ref = decode_attention(q.float(), kc.float(), vc.float(), tables.long(), lens)
        rows = []
        for name, cfg in candidates():
            fn = ((lambda: paged_decode(q, kc, vc, tables, lens, **cfg)) if name == "engine"  # noqa: E731
                  else (lambda: variant_decode(q, kc, vc, tables, lens, **cfg)))
            try:
                err = float((fn().float() - ref).norm() / ref.norm())
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as e:          # a setting that does not compile (registers, shared memory) is skipped
                rows.append({"kernel": name, **cfg, "error": str(e)[:200]})
                continue
            rows.append({"kernel": name, **cfg, "us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "rel_err": err})
        ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
        best = {k: min((r for r in ok if r["kernel"] == k), key=lambda r: r["us"], default=None)
                for k in ("engine", "early_v", "prefetch")}
        engine_default = next((r for r in ok if r["kernel"] == "engine" and (r["block_n"], r["num_warps"],
                                                                               r["num_stages"]) == (64, 4, 3)), None)
        key = f"{shape}_ctx{ctx}{'_mixed' if mixed else ''}"
        res["shapes"][key] = {"heads": [hq, hkv, dim], "bytes": nbytes, "engine_default": engine_default,
                              "best": best, "all": rows}
        print(key, "default", engine_default and round(engine_default["tb_s"], 2),
              {k: v and (round(v["tb_s"], 2), v["block_n"], v["num_warps"], v["num_stages"]) for k, v in best.items()},
              flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
