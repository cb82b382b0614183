"""A stream-K GEMM for a decode step's row counts, written in Gluon (Triton's explicit Hopper layer: TMA, mbarriers,
warpgroup MMA), against cuBLAS. A prototype for the question the engine's profile leaves: can a kernel that gives
every SM the same share of the work beat cuBLAS, whose fixed tiles leave waves part-empty at 256 rows?

    python bench/decode_gemm_gluon.py [--models 0.5b,1.5b] [--rows 256] [--configs 256:128:8:4,...]
                                      [--out bench/results/decode_gemm_gluon_<device>.json]

The kernel: Y = X W^T for X (M <= 256, K) and W (N, K) in bf16, float32 accumulation. A tile is BM rows (256: the
whole batch, TMA zero-filling the rows past M; or 128, row blocks fastest so that neighbours share a weight tile) by
BN columns; the work is the (tile, k-step) pairs in tile order, and program g of
G takes the contiguous run [g * total // G, (g + 1) * total // G) of them, so every program does the same number of
k-steps whatever the tile count. A run covers the end of some tiles and the start of at most one more, and goes
backwards, so that the tile it starts but does not finish comes first: its partial sum goes to a float32 workspace
slot of its own, with a flag, before anything else (going forwards, each program's partial came at the end of its
run and the next program waited for it: a chain through every program, 10-30x slower than cuBLAS). A tile the run
finishes alone it stores; a tile others started it finishes last, waiting for their flags and adding their
partials in program order (deterministic: the same sum for the same shape and grid) before it stores. A TMA ring
(`stages`) keeps stages - 1 k-steps of loads ahead of the MMA, across tile boundaries. With `swiglu` the tile is
BN features of the fused gate/up weight (rows j and I + j: two MMAs, two accumulators) and the store is
silu(gate) * up: the MLP's activation in the GEMM's epilogue.

Per model and row count, bf16, one CUDA graph of one launch per layer, each layer its own weights (`--layers`),
replayed `--reps` times: microseconds per layer for cuBLAS (`torch.mm`; down also as the engine's 4-way split bmm)
and the stream-K kernel (plain, and SwiGLU-fused for gate/up against cuBLAS + the compiled SwiGLU), the
norm-relative error against a float64 product, and whether two runs agree bit for bit.

Answer on an H100 (decode_gemm_gluon_nvidia-h100-80gb-hbm3.json, Triton 3.6): correct and deterministic, not fast.
Best against cuBLAS at 256 rows: 1.5B gate/up 45.9 vs 26.8 us (SwiGLU-fused 43.3 vs cuBLAS + SwiGLU 32.0), down
32.3 vs the engine's split bmm 15.4, 0.5B gate/up 21.0 vs 12.3. Its data-parallel form (`:-1`, nothing to fix up) is
no faster: the main loop loses, at about half an SM's MMA rate (ncu, `bench/ncu_targets.py gemm`: 34-37% SM
throughput against cuBLAS's 67%, ~1.7-1.9x its L2 bytes for the same product).
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

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

BM = 256      # rows of a tile: a decode step's whole batch
CONFIGS = "256:128:8:4,256:64:8:4,128:128:8:6,128:128:4:6,128:64:4:8"     # bm:bn:warps:stages swept by default


@gluon.jit
def _issue_loads(x_desc, w_desc, bars, x_bufs, w_bufs, u_bufs, q, start, end, KT, INTER, MT, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, SWIGLU: gl.constexpr):
    """The TMA loads of the run's q-th k-step (the run goes backwards: k-step end - 1 - q) into ring slot q % STAGES
    (none past the run's start)."""
    p = end - 1 - q
    pred = p >= start
    t = p // KT
    kk = p - t * KT
    off_m = (t % MT) * x_desc.block_type.shape[0]         # tiles: row blocks fastest, so neighbours share W's
    off_n = (t // MT) * BN
    s = q % STAGES
    bar = bars.index(s)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes * (2 if SWIGLU else 1)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, kk * BK], bar, x_bufs.index(s), pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, kk * BK], bar, w_bufs.index(s), pred)
    if SWIGLU:
        tma.async_copy_global_to_shared(w_desc, [INTER + off_n, kk * BK], bar, u_bufs.index(s), pred)


@gluon.jit
def _wait(acc, acc_u, SWIGLU: gl.constexpr, LAST_IN_FLIGHT: gl.constexpr):
    """The MMAs issued so far complete, but the last k-step's when LAST_IN_FLIGHT (its one MMA, two with SwiGLU)."""
    if SWIGLU:
        acc, acc_u = warpgroup_mma_wait(num_outstanding=2 if LAST_IN_FLIGHT else 0, deps=(acc, acc_u))
    else:
        acc = warpgroup_mma_wait(num_outstanding=1 if LAST_IN_FLIGHT else 0, deps=(acc, ))
    return acc, acc_u


@gluon.jit
def _streamk_kernel(x_desc, w_desc, y_ptr, ws_ptr, flag_ptr, M, stride_y, KT, TOTAL, INTER, MT,
                    SWIGLU: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BMc: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    u_bufs = w_bufs
    if SWIGLU:
        u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    g = gl.program_id(0)
    G = gl.num_programs(0)
    start = g * TOTAL // G
    end = (g + 1) * TOTAL // G
    parts: gl.constexpr = 2 if SWIGLU else 1

    for q in gl.static_range(STAGES - 1):
        _issue_loads(x_desc, w_desc, bars, x_bufs, w_bufs, u_bufs, q, start, end, KT, INTER, MT, BN, BK, STAGES,
                     SWIGLU)
    acc = gl.zeros((BMc, BN), dtype=gl.float32, layout=layout)
    acc_u = gl.zeros((BMc, BN), dtype=gl.float32, layout=layout)
    use_acc = gl.to_tensor(False)
    for i in range(0, end - start):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
        if SWIGLU:
            acc_u = warpgroup_mma(x_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, use_acc=use_acc,
                                  is_async=True)
        # the previous k-step's MMAs done, this one's in flight: the previous slot takes the loads STAGES - 1 on
        acc, acc_u = _wait(acc, acc_u, SWIGLU, True)
        _issue_loads(x_desc, w_desc, bars, x_bufs, w_bufs, u_bufs, i + STAGES - 1, start, end, KT, INTER, MT, BN, BK,
                     STAGES, SWIGLU)
        use_acc = gl.to_tensor(True)
        c = end - 1 - i
        t = c // KT
        if c == gl.maximum(start, t * KT):          # the run's last k-step of this tile (its lowest)
            acc, acc_u = _wait(acc, acc_u, SWIGLU, False)
            use_acc = gl.to_tensor(False)
            # built here, not before the loop: a (BM, BN) offset tensor kept live costs as many registers as acc
            rows = gl.arange(0, BMc, layout=gl.SliceLayout(1, layout))
            cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            tile_offs = rows[:, None] * BN + cols[None, :]                 # a tile's place in a workspace slot
            if end >= (t + 1) * KT:                     # this run holds the tile's last k-step: it finishes the tile
                if start > t * KT:
                    # others started this tile: add their partials, in program order
                    first = t * KT
                    j = first * G // TOTAL
                    while (j + 1) * TOTAL // G <= first:
                        j += 1
                    while j < g:
                        while gl.atomic_add(flag_ptr + j, 0, sem="acquire") == 0:
                            pass
                        slot = ws_ptr + j * (parts * BMc * BN)
                        acc += gl.load(slot + tile_offs, cache_modifier=".cg")
                        if SWIGLU:
                            acc_u += gl.load(slot + BMc * BN + tile_offs, cache_modifier=".cg")
                        gl.atomic_xchg(flag_ptr + j, 0, sem="relaxed")
                        j += 1
                if SWIGLU:
                    out = acc * (1.0 / (1.0 + gl.exp(-acc))) * acc_u
                else:
                    out = acc
                out_rows = (t % MT) * BMc + rows
                ptrs = y_ptr + out_rows[:, None] * stride_y + ((t // MT) * BN + cols)[None, :]
                gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=(out_rows < M)[:, None])
            else:
                # this run ends inside the tile (its first segment, so published at once): its partial to its own
                # slot, then its flag
                slot = ws_ptr + g * (parts * BMc * BN)
                gl.store(slot + tile_offs, acc)
                if SWIGLU:
                    gl.store(slot + BMc * BN + tile_offs, acc_u)
                gl.thread_barrier()
                gl.atomic_xchg(flag_ptr + g, 1, sem="release")
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


class StreamK:
    """Y = X W^T (or SwiGLU of the fused gate/up product) by `_streamk_kernel`, with its workspace and flags."""

    def __init__(self, n: int, k: int, device, *, swiglu: bool = False, bm: int = BM, bn: int = 128, bk: int = 64,
                 stages: int = 4, num_warps: int = 8, grid: int | None = None, rows: int = BM):
        self.n_out = n // 2 if swiglu else n
        if self.n_out % bn:
            raise ValueError(f"{self.n_out} output features are not a multiple of BN={bn}")
        self.swiglu, self.bn, self.bk, self.stages, self.num_warps = swiglu, bn, bk, stages, num_warps
        self.kt = triton.cdiv(k, bk)
        self.bm, self.mt = bm, triton.cdiv(rows, bm)
        self.total = self.mt * (self.n_out // bn) * self.kt
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # grid -1: one program per tile (data-parallel: runs align with tiles, nothing to fix up, any count runs);
        # otherwise at most one per SM, so that a finisher never waits on a program that has no SM to run on
        self.grid = self.total // self.kt if grid == -1 else min(grid or sms, sms, self.total)
        parts = 2 if swiglu else 1
        self.ws = torch.empty(self.grid * parts * bm * bn, device=device, dtype=torch.float32)
        self.flags = torch.zeros(self.grid, device=device, dtype=torch.int32)
        self.x_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
        self.w_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.mt * self.bm:
            raise ValueError(f"at most {self.mt * self.bm} rows (built for them)")
        x_desc = TensorDescriptor.from_tensor(x, [self.bm, self.bk], self.x_layout)
        w_desc = TensorDescriptor.from_tensor(w, [self.bn, self.bk], self.w_layout)
        _streamk_kernel[(self.grid,)](x_desc, w_desc, out, self.ws, self.flags, x.shape[0], out.stride(0), self.kt,
                                      self.total, self.n_out, self.mt, SWIGLU=self.swiglu, STAGES=self.stages,
                                      num_warps=self.num_warps)
        return out


def bench_model(name: str, rows: int, args) -> dict:
    from decode_gemms import MODELS, projections
    from train import graph_step_us
    from lathe.models.decoder import split_linear
    inter = MODELS[name][1]
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = projections(name)
    g = torch.Generator(device=dev).manual_seed(rows)
    res = {}
    for proj, (k, n) in shapes.items():
        if proj not in args.projections:
            continue
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k ** -0.5 for _ in range(args.layers)]
        x = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
        exact = x.double() @ ws[0].double().T
        act_exact = F.silu(exact[:, :inter]) * exact[:, inter:] if proj == "gate_up" else None
        outs = [torch.empty(rows, n, device=dev, dtype=dt) for _ in range(args.layers)]
        hs = [torch.empty(rows, inter, device=dev, dtype=dt) for _ in range(args.layers)]

        def us(fn):
            return graph_step_us(lambda: [fn(i) for i in range(args.layers)], args.reps, steps=1) / args.layers

        def err(got, want):
            return float((got.double() - want).norm() / want.norm())

        row = {"k": k, "n": n, "cublas": {"us": us(lambda i: torch.mm(x, ws[i].t(), out=outs[i])),
                                          "rel_err": err(torch.mm(x, ws[0].t()), exact)}}
        if proj == "down":
            lin = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt) for _ in range(args.layers)]
            for layer, w in zip(lin, ws):
                layer.weight.data = w
            row["cublas_split4_bmm"] = {"us": us(lambda i: split_linear(x, lin[i], 4))}
        if proj == "gate_up":
            act = torch.compile(lambda t: F.silu(t[:, :inter]) * t[:, inter:], dynamic=False)
            row["cublas_swiglu"] = {"us": us(lambda i: act(torch.mm(x, ws[i].t(), out=outs[i]))),
                                    "rel_err": err(act(torch.mm(x, ws[0].t())), act_exact)}
        configs = [tuple(int(v) for v in (c + ":0").split(":")[:5]) for c in args.configs]   # bm:bn:warps:stages:grid
        variants = [("streamk", False, c) for c in configs]
        if proj == "gate_up":
            variants += [("streamk_swiglu", True, (bm, bn // 2, w, st, gr)) for bm, bn, w, st, gr in configs]
        for kind, swiglu, (bm, bn, warps, stages, grid) in variants:
            key = f"{kind}_{bm}x{bn}_w{warps}_s{stages}" + ("_dp" if grid == -1 else f"_g{grid}" if grid else "")
            try:
                kern = StreamK(n, k, dev, swiglu=swiglu, bm=bm, bn=bn, num_warps=warps, stages=stages, rows=rows,
                               grid=grid or None)
                dst = hs if swiglu else outs
                first = kern(x, ws[0], dst[0]).clone()
                second = kern(x, ws[0], dst[0]).clone()
                row[key] = {"us": us(lambda i, kern=kern, dst=dst: kern(x, ws[i], dst[i])),
                            "rel_err": err(first, act_exact if swiglu else exact),
                            "deterministic": bool(torch.equal(first, second)), "grid": kern.grid,
                            "k_steps_per_program": kern.total / kern.grid}
            except Exception as exc:          # a configuration that does not build or fit: recorded
                row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, rows, proj, {v: (r.get("us") and round(r["us"], 2), r.get("error", "")[:80])
                                 for v, r in row.items() if isinstance(r, dict)}, flush=True)
        res[proj] = row
    return res


def main() -> None:
    from train import result_header, write_result
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--rows", default="256")
    ap.add_argument("--projections", default="gate_up,down,qkv,o")
    ap.add_argument("--configs", default=CONFIGS,
                    help="stream-K bm:bn:warps:stages[:grid] (SwiGLU: bn halved, gate and up; grid -1: one program "
                         "per tile, data-parallel; default one per SM)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.projections = args.projections.split(",")
    args.configs = args.configs.split(",")
    res = result_header("decode_gemm_gluon", torch.device("cuda"), args, triton=triton.__version__, models={})
    for name in args.models.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            res["models"].setdefault(name, {})[rows] = bench_model(name, rows, args)
            write_result(res, args.out)


if __name__ == "__main__":
    main()
