"""The decode step's projections in a CUDA graph: cuBLAS against a split-K Triton kernel written for them.

    python bench/decode_linear.py [--rows 64,128,256,512] [--models 0.5b,1.5b,7b] [--sweep]
                                  [--out bench/results/decode_linear_<device>.json]

The question: at a decode step's row counts, projections with few output columns (o, down, q/k/v of the small
models) have few output tiles, and cuBLAS reads their weights far below HBM speed
(bench/results/decode_gemms_*.json). Would a kernel that splits the reduction dimension across the SMs do better?
The candidate lives here: each program computes one (rows x columns) tile over one slice of K; the slices write
float32 partial tiles, and the program that finishes a tile last (a per-tile counter, reset to zero by that
program, so the launch is CUDA-graph safe) sums the partials in slice order (deterministic), adds the bias and
writes bf16.

For each Qwen2.5 projection (fused q/k/v with bias, o, fused gate/up, down) and row count, bf16: one CUDA graph of
one launch per layer, each layer its own weight (as in the decode graph: no weight stays in L2 from the launch
before), replayed `--reps` times; the time per launch is the replay time over the layer count. Candidates:
`F.linear` (cuBLAS, what the engine runs), `torch.addmm(residual, ...)` (cuBLAS with the residual add a compiled
layer fuses into o and down), the kernel with `plan`'s configuration, and with `--sweep` the best of a grid of
configurations. Each Triton result is checked against a float64 product (norm-relative error).

Answer on an H100 (decode_linear_nvidia-h100-80gb-hbm3.json): no. cuBLAS in a graph is faster at every shape and
row count but the large gate/up products at 64 rows, where the two are within 3% (0.5B down at 256 rows: 10.4 us vs
14.2 us for the best configuration swept); the kernel stays here, out of the engine.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from decode_gemms import MODELS  # noqa: E402
from train import graph_step_us, result_header, write_result  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _linear_kernel(X, W, B, OUT, PART, COUNT, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_ptr = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptr = W + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = (k + rk) < k_end
        a = tl.load(x_ptr + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    out_ptr = OUT + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr, acc.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_elems = BLOCK_M * BLOCK_N
        within = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = PART + tile.to(tl.int64) * (SPLIT_K * tile_elems) + within
        tl.store(part + pid_k * tile_elems, acc)
        tl.debug_barrier()          # every thread's partial is written before the counter moves
        done = tl.atomic_add(COUNT + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:     # the last slice of this tile: sum all slices in order, then reset the counter
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * tile_elems, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr, total.to(OUT.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(COUNT + tile, 0)


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def plan(m: int, n: int, k: int, num_sms: int) -> Plan:
    """The configuration for an (m x k) @ (k x n) product: row tiles of up to 128 rows, 64-column tiles, and the
    reduction split so that the grid fills the SMs once (each slice at least four 64-deep steps)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(num_sms // tiles, k // (4 * block_k), 16))
    return Plan(block_m, block_n, block_k, split)


_WORKSPACES: dict[torch.device, list[torch.Tensor]] = {}


def _workspace(device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device float32 partial-tile buffer and int32 tile counters (zero between launches), grown when a larger
    product comes. A grown buffer does not free the old one: a captured CUDA graph may still point at it."""
    held = _WORKSPACES.setdefault(device, [])
    if held and held[-2].numel() >= part_elems and held[-1].numel() >= tiles:
        return held[-2], held[-1]
    part = torch.empty(max(part_elems, held[-2].numel() if held else 0), dtype=torch.float32, device=device)
    count = torch.zeros(max(tiles, held[-1].numel() if held else 0, 1024), dtype=torch.int32, device=device)
    held += [part, count]
    return part, count


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: Plan | None = None, num_sms: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 2-D `x` (rows, k) with unit stride along k and a row-major weight (n, k).
    `config` overrides `plan` (benchmarks); `num_sms` defaults to the device's."""
    m, k = x.shape
    n = weight.shape[0]
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    p = config or plan(m, n, k, num_sms)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid_n, grid_m = triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m)
    k_per_split = triton.cdiv(triton.cdiv(k, p.split_k), p.block_k) * p.block_k
    split = triton.cdiv(k, k_per_split)          # rounding the slices to whole steps may leave fewer of them
    tiles = grid_n * grid_m
    part, count = _workspace(x.device, tiles * split * p.block_m * p.block_n if split > 1 else 0, tiles)
    _linear_kernel[(grid_n, grid_m, split)](
        x, weight, bias if bias is not None else out, out, part, count, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, SPLIT_K=split, num_warps=p.num_warps, num_stages=p.num_stages)
    return out

LAYERS = {"0.5b": 24, "1.5b": 28, "7b": 28}


def graph_us(fn, layers: int, reps: int) -> float:
    """Microseconds per launch of `fn(i)` for i in range(layers), captured in one CUDA graph."""
    return graph_step_us(lambda: [fn(i) for i in range(layers)], reps, steps=1) / layers


def sweep_configs(m: int) -> list:
    out = []
    for bm in (64, 128, 256):
        if bm > max(64, 2 * m):
            continue
        for bn in (32, 64, 128):
            if bm * bn > 128 * 128:
                continue
            for split in (1, 2, 4, 8):
                out.append(Plan(bm, bn, 64, split, num_warps=8 if bm * bn >= 128 * 128 else 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256,512")
    ap.add_argument("--models", default="0.5b,1.5b,7b")
    ap.add_argument("--projections", default="qkv,o,gate_up,down")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-weight-gb", type=float, default=4.0, help="fewer layers when the weights would exceed this")
    ap.add_argument("--bandwidth", type=float, default=3.35e12)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    res = {**result_header("decode_linear", device, args, sms=sms), "models": {}}
    for model in args.models.split(","):
        h, inter, hq, hkv, d, _ = MODELS[model]
        shapes = {"qkv": (h, (hq + 2 * hkv) * d, True), "o": (hq * d, h, False), "gate_up": (h, 2 * inter, False),
                  "down": (inter, h, False)}
        rows_out = res["models"].setdefault(model, {})
        for proj in args.projections.split(","):
            k, n, bias = shapes[proj]
            layers = max(1, min(LAYERS[model], int(args.max_weight_gb * 1e9 // (n * k * 2))))
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
            bs = [torch.randn(n, device=device, dtype=torch.bfloat16) if bias else None for _ in range(layers)]
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                r = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                wbytes = n * k * 2
                row = {"m": m, "k": k, "n": n, "bias": bias, "layers": layers, "weight_bytes": wbytes}

                def rate(us):
                    return {"us": us, "tb_s": wbytes / us / 1e6}
                row["linear"] = rate(graph_us(lambda i: F.linear(x, ws[i], bs[i]), layers, args.reps))  # noqa: B023
                if not bias:
                    row["addmm_residual"] = rate(graph_us(lambda i: torch.addmm(r, x, ws[i].t()), layers, args.reps))  # noqa: B023
                ref = F.linear(x.double(), ws[0].double(), bs[0].double() if bias else None)
                p = plan(m, n, k, sms)
                got = linear(x, ws[0], bs[0])
                row["plan"] = {**rate(graph_us(lambda i: linear(x, ws[i], bs[i]), layers, args.reps)),  # noqa: B023
                               "config": p.__dict__,
                               "rel_err": ((got.double() - ref).norm() / ref.norm()).item()}
                if args.sweep:
                    best = None
                    for c in sweep_configs(m):
                        try:
                            us = graph_us(lambda i: linear(x, ws[i], bs[i], config=c), layers, args.reps)  # noqa: B023
                        except Exception as e:   # a configuration that does not compile or fit: skipped
                            print("skip", c, type(e).__name__, str(e)[:120], flush=True)
                            continue
                        if best is None or us < best[0]:
                            best = (us, c)
                    if best is not None:
                        got = linear(x, ws[0], bs[0], config=best[1])
                        row["sweep_best"] = {**rate(best[0]), "config": best[1].__dict__,
                                             "rel_err": ((got.double() - ref).norm() / ref.norm()).item()}
                rows_out.setdefault(proj, []).append(row)
                print(model, proj, m, {c: round(v["us"], 2) for c, v in row.items() if isinstance(v, dict)},
                      row.get("sweep_best", {}).get("config"), flush=True)
            del ws, bs
            torch.cuda.empty_cache()
    write_result(res, args.out)


if __name__ == "__main__":
    main()
