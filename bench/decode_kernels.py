"""Decode-attention kernel configurations at the engine's shapes: which Triton tile and launch settings read the
KV cache fastest.

    python bench/decode_kernels.py [--batches 256] [--contexts 512,1024] [--splits 1,2,3,4]
                                   [--out bench/results/decode_kernels_<device>.json]

For each Qwen2.5 attention shape (0.5B 14/2 heads of 64, 1.5B 12/2 of 128, 7B 28/4 of 128), a bf16 paged cache
with shuffled block tables, and every (num_splits, BLOCK_N, num_warps, num_stages) of a small grid: the median time of
`paged_decode` (triton.testing.do_bench) and the bandwidth it reaches (K and V bytes read over time). The
engine's setting is marked; the fastest per shape is what `triton_decode` should use. (A kernel with every head of a
sequence in one program measured the same bandwidth: `bench/results/decode_kernels_all_heads_*.json`, eeb94d5.)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

from lathe.engine.paged_attention import decode_attention  # noqa: E402
from lathe.engine.triton_decode import choose_num_splits, paged_decode  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def main() -> None:
    import triton
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="256")
    ap.add_argument("--contexts", default="512,1024")
    ap.add_argument("--splits", default="1,2,3,4")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    res = {**result_header("decode_kernels", device, args, triton=triton.__version__), "shapes": {}}
    g = torch.Generator(device=device).manual_seed(0)
    for shape, (hq, hkv, dim) in SHAPES.items():
        for b, ctx in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
            page = args.page
            per = -(-ctx // page)
            blocks = b * per + 1
            kc = torch.randn(blocks, page, hkv, dim, device=device, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            tables = torch.randperm(blocks - 1, device=device, generator=g)[:b * per].view(b, per).int()
            lens = torch.full((b,), ctx, device=device, dtype=torch.int64)
            q = torch.randn(b, hq, dim, device=device, dtype=torch.bfloat16, generator=g)
            nbytes = 2 * b * ctx * hkv * dim * 2
            ref = decode_attention(q.float(), kc.float(), vc.float(), tables.long(), lens)
            splits = choose_num_splits(b, hkv, sms)
            rows = []
            grid = [(s, bn, w, st) for s in map(int, args.splits.split(",")) for bn, w, st in
                    itertools.product((32, 64), (2, 4), (3, 4))]
            counters = torch.zeros(b * hkv, dtype=torch.int32, device=device)    # as a decode step passes them
            for split, bn, warps, stages in grid:
                try:
                    fn = lambda: paged_decode(q, kc, vc, tables, lens, num_splits=split, block_n=bn,  # noqa: E731
                                              num_warps=warps, num_stages=stages, counters=counters)
                    err = float((fn().float() - ref).norm() / ref.norm())
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                except Exception as e:          # a configuration that does not compile (shared memory) is skipped
                    rows.append({"num_splits": split, "block_n": bn, "num_warps": warps, "num_stages": stages,
                                 "error": str(e)[:200]})
                    continue
                rows.append({"num_splits": split, "block_n": bn, "num_warps": warps, "num_stages": stages, "ms": ms,
                             "tb_s": nbytes / ms / 1e9, "rel_err": err,
                             "engine_default": (split, bn, warps, stages) == (splits, 64, 4, 3)})
            ok = [r for r in rows if "ms" in r]
            best = min(ok, key=lambda r: r["ms"])
            default = next(r for r in ok if r["engine_default"])
            res["shapes"][f"{shape}_b{b}_ctx{ctx}"] = {"heads": [hq, hkv, dim], "num_splits": splits, "bytes": nbytes,
                                                  "best": best, "default": default, "all": rows}
            print(f"{shape} batch {b} ctx {ctx}: default {default['ms']*1e3:.1f} us ({default['tb_s']:.2f} TB/s), best "
                  f"{best['ms']*1e3:.1f} us ({best['tb_s']:.2f} TB/s) at splits {best['num_splits']} block_n {best['block_n']} warps "
                  f"{best['num_warps']} stages {best['num_stages']}", flush=True)
            del kc, vc
    write_result(res, args.out)


if __name__ == "__main__":
    main()
