"""cuBLAS at a decode step's row counts, cut differently: does splitting a projection's output columns (or its
reduction dimension) into launches whose tile counts fill the GPU's SMs evenly beat one launch?

    python bench/decode_waves.py [--models 0.5b,1.5b] [--rows 256] [--out bench/results/decode_waves_<device>.json]

Why: at 256 rows the fused gate/up product of 1.5B (1536 -> 17920) has 280 output tiles of 128x128 for 132 SMs,
2.12 waves that take three; 0.5B's (896 -> 9728) 152, 1.15 waves that take two. Output columns are independent, so
the product can run as two launches into column slices of one output (cuBLAS writes a row-strided output in place):
a first whose tiles fill whole waves and a small remainder. The down projection's K splits (`split_linear`, a
batched matmul of `s` chunks) change its tile count the same way.

Per model and row count, bf16, one CUDA graph of one launch (or pair) per layer, each layer its own weights (no
weight stays in L2 from the launch before), replayed `--reps` times; microseconds per layer:
- gate_up: `F.linear` whole, and in two column pieces for each first-piece width of `--gate-up-cuts` (multiples of
  128 columns counted from the full width down: 0 = whole);
- down: `split_linear` at each K split that divides the input features (1 = plain `F.linear`);
- o and qkv: the same K splits (o) and the column cuts (qkv).
Each variant is checked against the whole product (norm-relative error) and the kernel names of each launch are
recorded (torch.profiler) so that the tiles cuBLAS picked can be read off.

Answer on an H100 (decode_waves_nvidia-h100-80gb-hbm3.json): no. Every column cut of gate/up is slower than the whole
product (1.5B 27.2 us vs 31-34 us in two launches): the second launch costs more than the idle SMs of the last wave.
Down's best K split is the engine's rule's (1.5B: 4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from decode_gemms import projections  # noqa: E402
from train import graph_step_us, result_header, write_result  # noqa: E402

from lathe.models.decoder import split_linear  # noqa: E402


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def column_cut(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, first: int) -> torch.Tensor:
    """x @ w.T into `out` as two launches: columns [0, first) and [first, N), each written into its slice."""
    torch.mm(x, w[:first].t(), out=out[:, :first])
    torch.mm(x, w[first:].t(), out=out[:, first:])
    return out


def bench_model(name: str, rows: int, args) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = args.layers
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = projections(name)
    res = {}
    for proj, (k, n) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k ** -0.5 for _ in range(layers)]
        x = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
        outs = [torch.empty(rows, n, device=dev, dtype=dt) for _ in range(layers)]
        ref = F.linear(x, ws[0]).float()
        variants = {"whole": lambda i: torch.mm(x, ws[i].t(), out=outs[i])}
        if proj in ("gate_up", "qkv"):
            for cut in args.gate_up_cuts:
                first = n - 128 * cut
                if 0 < cut and 0 < first < n:
                    variants[f"cols_{first}+{n - first}"] = (
                        lambda f: lambda i: column_cut(x, ws[i], outs[i], f))(first)
        if proj in ("down", "o"):
            for s in args.splits:
                if s > 1 and k % s == 0:
                    lin = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt) for _ in range(layers)]
                    for layer, w in zip(lin, ws):
                        layer.weight.data = w
                    variants[f"split_k{s}"] = (lambda s, lin: lambda i: split_linear(x, lin[i], s))(s, lin)
        row = {"k": k, "n": n, "weight_mb": n * k * 2 / 1e6}
        for vname, fn in variants.items():
            with torch.inference_mode():
                got = fn(0)
                got = (got.float().sum(0) if got.dim() == 3 else got.float())
                err = float((got - ref).norm() / ref.norm())
                us = graph_step_us(lambda: [fn(i) for i in range(layers)], args.reps, steps=1) / layers
                row[vname] = {"us": round(us, 2), "tb_s": round(n * k * 2 / us / 1e6, 3), "rel_err": err,
                              "kernels": kernel_names(lambda: fn(0))}
        timed = {v: r["us"] for v, r in row.items() if isinstance(r, dict)}
        best = min(timed, key=timed.get)
        row["best"] = {"variant": best, "us": timed[best], "vs_whole": timed[best] / timed["whole"]}
        print(name, rows, proj, {v: t for v, t in timed.items()}, flush=True)
        res[proj] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--rows", default="256")
    ap.add_argument("--gate-up-cuts", default="2,4,6,8,10,12,16,20,24,32,40,48,64,70")
    ap.add_argument("--splits", default="2,3,4,5,7,8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.gate_up_cuts = [int(c) for c in args.gate_up_cuts.split(",")]
    args.splits = [int(s) for s in args.splits.split(",")]
    res = result_header("decode_waves", torch.device("cuda"), args,
                        sms=torch.cuda.get_device_properties(0).multi_processor_count, models={})
    for name in args.models.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            res["models"].setdefault(name, {})[rows] = bench_model(name, rows, args)
            write_result(res, args.out)


if __name__ == "__main__":
    main()
