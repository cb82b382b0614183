"""The lm_head and the fused sampler's chunk pass at a decode step (256 rows), timed in CUDA graphs
(bench/train.py's graph_step_us) at Qwen2.5-0.5B/1.5B's hidden sizes, bf16:

- `gemm`: the lm_head product alone (cuBLAS), `gemm_t`: its transpose (weight x hidden^T);
- `gemm_sample`: the product and the engine's fused sampler (chunk pass + pick);
- `gemm_chunk_<chunk>_<warps>`: the product and the chunk pass at a chunk size and warp count;
- `pieces_<P>`: the product in P vocabulary pieces, each followed by the engine's chunk pass over its piece, so that
  a piece's logits may still be in L2 when the pass reads them (`pieces_<P>_match`: equal to the whole pass).

    python bench/lm_head_pieces.py [--out bench/results/lm_head_pieces_<device>.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import graph_step_us, result_header, write_result  # noqa: E402

import triton  # noqa: E402

from lathe.engine import triton_sample as ts  # noqa: E402

ROWS, VOCAB, CHUNK = 256, 151936, 4096


def measure(hidden: int, dev, reps: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(VOCAB, hidden, device=dev, generator=g).mul_(0.02).bfloat16()
    h = torch.randn(ROWS, hidden, device=dev, generator=g).bfloat16()
    temp, greedy = torch.ones(ROWS, device=dev), torch.zeros(ROWS, dtype=torch.int32, device=dev)
    seeds, pos = torch.arange(ROWS, device=dev), torch.zeros(ROWS, dtype=torch.int64, device=dev)
    sampled = torch.empty(2, ROWS, dtype=torch.float64, device=dev)
    logits = torch.empty(ROWS, VOCAB, device=dev, dtype=torch.bfloat16)
    logits_t = torch.empty(VOCAB, ROWS, device=dev, dtype=torch.bfloat16)
    row = {"gemm": graph_step_us(lambda: torch.mm(h, w.t(), out=logits), reps),
           "gemm_t": graph_step_us(lambda: torch.mm(w, h.t(), out=logits_t), reps),
           "gemm_sample": graph_step_us(lambda: (torch.mm(h, w.t(), out=logits),
                                                 ts.fused_sample(logits, temp, greedy, seeds, pos, out=sampled)), reps)}
    for chunk, warps in ((4096, 8), (4096, 4), (8192, 8), (2048, 4), (2048, 2)):
        n = triton.cdiv(VOCAB, chunk)
        pm, pa = torch.empty(ROWS, n, device=dev), torch.empty(ROWS, n, dtype=torch.int32, device=dev)
        ps = torch.empty_like(pm)

        def chunk_pass(n=n, pm=pm, ps=ps, pa=pa, chunk=chunk, warps=warps):
            torch.mm(h, w.t(), out=logits)
            ts._chunk_kernel[(ROWS, n)](logits, logits.stride(0), VOCAB, temp, greedy, pm, ps, pa, n, CHUNK_=chunk,
                                        num_warps=warps)
        row[f"gemm_chunk_{chunk}_{warps}"] = graph_step_us(chunk_pass, reps)
    nch = triton.cdiv(VOCAB, CHUNK)
    whole = [torch.empty(ROWS, nch, device=dev), torch.empty(ROWS, nch, device=dev),
             torch.empty(ROWS, nch, dtype=torch.int32, device=dev)]
    torch.mm(h, w.t(), out=logits)
    ts._chunk_kernel[(ROWS, nch)](logits, logits.stride(0), VOCAB, temp, greedy, *whole, nch, CHUNK_=CHUNK, num_warps=8)
    for pieces in (2, 3, 4, 6, 8):
        per = triton.cdiv(nch, pieces) * CHUNK                     # tokens a piece, whole chunks
        bounds = [(a, min(VOCAB, a + per)) for a in range(0, VOCAB, per)]
        outs = [torch.empty(ROWS, b - a, device=dev, dtype=torch.bfloat16) for a, b in bounds]
        stats = [torch.empty_like(t) for t in whole]

        def pieces_pass(bounds=bounds, outs=outs, stats=stats):
            for (a, b), out in zip(bounds, outs):       # the engine's pass over a piece: its stats at column a/CHUNK
                torch.mm(h, w[a:b].t(), out=out)
                ts._chunk_kernel[(ROWS, triton.cdiv(b - a, CHUNK))](out, out.stride(0), b - a, temp, greedy,
                                                                    *(t[:, a // CHUNK:] for t in stats), nch,
                                                                    CHUNK_=CHUNK, num_warps=8)
        row[f"pieces_{len(bounds)}"] = graph_step_us(pieces_pass, reps)
        pieces_pass()
        first = torch.cat([stats[2][:, a // CHUNK:triton.cdiv(b, CHUNK)] + a for a, b in bounds], dim=1)  # piece -> row
        row[f"pieces_{len(bounds)}_match"] = bool(torch.equal(stats[0], whole[0]) and torch.equal(first, whole[2])
                                                  and torch.allclose(stats[1], whole[1], rtol=1e-5))
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = result_header("lm_head_pieces", dev, args, rows={})
    for name, hidden in (("0.5b", 896), ("1.5b", 1536)):
        res["rows"][name] = measure(hidden, dev, args.reps)
        print(name, res["rows"][name], flush=True)
        torch.cuda.empty_cache()
    print(f"wrote {write_result(res, args.out)}")


if __name__ == "__main__":
    main()
