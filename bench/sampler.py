"""The sampler alone on a decode step's logits: the PyTorch path (a sort for top-p, `topk` for top-k) vs the fused
Triton sampler with its top-k/top-p searches, eager and inside a CUDA graph (as a decode step replays it).

Logits (B, V) in bf16 at Qwen2.5's vocabulary, drawn as a model's are spread: a few hundred plausible tokens above a
long tail. Each setting is timed over `--iters` calls after a warm-up (CUDA events), and the fused draws are
compared with the PyTorch path's, token for token (the two sum in different orders, so a draw that lands within
rounding of a boundary may differ: the count of differing rows is reported).

    python bench/sampler.py --out /tmp/sampler.json
    python bench/sampler.py --chunk-sweep --settings "plain;top_p=0.95" --out /tmp/chunk.json   # chunk pass settings
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

from lathe.engine.sampler import fused_rows, fused_settings, sample_rows, sample_torch  # noqa: E402
from lathe.engine.sequence import Sequence, SequenceParams  # noqa: E402

SETTINGS = {"plain": {}, "top_k=50": {"top_k": 50}, "top_p=0.95": {"top_p": 0.95}, "top_p=0.7": {"top_p": 0.7},
            "top_k=50,top_p=0.95": {"top_k": 50, "top_p": 0.95}, "top_k=1000": {"top_k": 1000}}


def make_logits(batch: int, vocab: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, vocab, device=device, generator=g) * 2.0 - 4.0
    head = torch.randint(0, vocab, (batch, 300), device=device, generator=g)
    x.scatter_(1, head, torch.randn(batch, 300, device=device, generator=g) * 2.0 + 8.0)
    return x.bfloat16()


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_case(logits: torch.Tensor, setting: dict, iters: int) -> dict:
    b, v = logits.shape
    params = SequenceParams(temperature=1.0, **setting)
    seqs = [Sequence([1], params, 1000 + i) for i in range(b)]
    for i, s in enumerate(seqs):
        s.token_ids += [0] * (i % 97)                     # output positions differ between rows
    settings = fused_settings(logits.device, v, seqs)
    rows = torch.from_numpy(fused_rows(seqs, settings)).to(logits.device)
    out = torch.zeros(2, b, dtype=torch.float64, device=logits.device)

    def fused():
        sample_rows(logits, rows, out=out, use_k=settings.use_k, use_p=settings.use_p)

    row = {"torch_ms": time_ms(lambda: sample_torch(logits, seqs), iters), "fused_ms": time_ms(fused, iters)}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    row["fused_graph_ms"] = time_ms(graph.replay, iters)
    graph.replay()
    ref = sample_torch(logits, seqs)
    row["rows_differing"] = int((out[0] != ref[0]).sum())
    row["logprob_max_abs_diff"] = float((out[1] - ref[1]).abs().max())
    row["speedup_graph_vs_torch"] = row["torch_ms"] / row["fused_graph_ms"]
    return row


def sweep(args, device) -> dict:
    """Time each search (top-k's counting passes on top_k=50, top-p's mass passes on top_p=0.95) under each
    `SearchConfig` candidate, the fused sampler replayed from a CUDA graph."""
    import itertools

    from lathe.engine import triton_sample
    default = dict(triton_sample.SEARCH)
    rows = {}
    for search, case in (("top_k", "top_k=50"), ("top_p", "top_p=0.95")):
        for np_, sub, warps in itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4, 8)):
            triton_sample.SEARCH = {**default, search: triton_sample.SearchConfig(np_, sub, warps)}
            name = f"{search} np={np_} sub={sub} warps={warps}"
            for batch in args.batches:
                row = bench_case(make_logits(batch, args.vocab, device, batch), SETTINGS[case], args.iters)
                rows[f"{name} B={batch}"] = {k: row[k] for k in ("fused_graph_ms", "rows_differing")}
                print(f"{name} B={batch:4d} graph {row['fused_graph_ms']:7.3f} ms differ {row['rows_differing']}",
                      flush=True)
    triton_sample.SEARCH = default
    return rows


def chunk_sweep(args, device) -> dict:
    """Time the fused sampler under each chunk size and `_chunk_kernel` warp count (`triton_sample.CHUNK`,
    `CHUNK_WARPS`), replayed from a CUDA graph, in two interleaved rounds; the searches keep their own settings."""
    from lathe.engine import triton_sample
    default = (triton_sample.CHUNK, triton_sample.CHUNK_WARPS)
    rows = {}
    logits = {batch: make_logits(batch, args.vocab, device, batch) for batch in args.batches}
    for rnd in range(2):
        for chunk, warps in ((4096, 8), (4096, 4), (4096, 2), (2048, 4), (2048, 2), (8192, 8), (8192, 4)):
            triton_sample.CHUNK, triton_sample.CHUNK_WARPS = chunk, warps
            for batch in args.batches:
                for name in args.settings:
                    row = bench_case(logits[batch], SETTINGS[name], args.iters)
                    key = f"chunk={chunk} warps={warps} B={batch} {name}"
                    rows.setdefault(key, {"fused_graph_ms": [], "rows_differing": row["rows_differing"]})
                    rows[key]["fused_graph_ms"].append(row["fused_graph_ms"])
                    print(f"round {rnd} {key:48s} graph {row['fused_graph_ms']:7.3f} ms differ {row['rows_differing']}",
                          flush=True)
    triton_sample.CHUNK, triton_sample.CHUNK_WARPS = default
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--settings", type=lambda s: s.split(";"), default=list(SETTINGS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="time the searches' kernel configurations")
    ap.add_argument("--chunk-sweep", action="store_true", help="time chunk sizes and the chunk pass's warps")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = result_header("sampler", device, args, cases={})
    if args.sweep:
        res["sweep"] = sweep(args, device)
        print(f"wrote {write_result(res, args.out)}")
        return
    if args.chunk_sweep:
        res["chunk_sweep"] = chunk_sweep(args, device)
        print(f"wrote {write_result(res, args.out)}")
        return
    for batch in args.batches:
        logits = make_logits(batch, args.vocab, device, batch)
        for name in args.settings:
            row = bench_case(logits, SETTINGS[name], args.iters)
            res["cases"][f"B={batch} {name}"] = row
            print(f"B={batch:4d} {name:22s} torch {row['torch_ms']:7.3f} ms  fused {row['fused_ms']:7.3f}  "
                  f"graph {row['fused_graph_ms']:7.3f}  differ {row['rows_differing']}", flush=True)
    print(f"wrote {write_result(res, args.out)}")


if __name__ == "__main__":
    main()
