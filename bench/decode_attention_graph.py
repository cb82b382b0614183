"""Decode attention inside a CUDA graph: the paged Triton kernel launched once per layer (24 for 0.5B, 28 for 1.5B)
at batch 256 and several contexts, for a grid of launch settings (BLOCK_N:num_warps:num_stages[:num_splits]); the
median microseconds per layer over 20 replays and the bandwidth (K and V bytes over that time). Unlike
`bench/decode_kernels.py` (do_bench, one launch, L2 flushed) this times launches back to back as a decode step
replays them (four caches in turn, each larger than L2). `--ncu` runs each setting once, without a graph, for Nsight Compute.

    python bench/decode_attention_graph.py [--models 0.5b,1.5b] [--contexts 256,512,768] [--out out.json]
"""
import sys, json, argparse
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch
from lathe.engine.triton_decode import paged_decode

SHAPES = {"0.5b": (14, 2, 64, 24), "1.5b": (12, 2, 128, 28)}
ap = argparse.ArgumentParser()
ap.add_argument("--models", default="0.5b,1.5b")
ap.add_argument("--contexts", default="256,512,768")
ap.add_argument("--configs", default="64:4:3,64:2:3,32:4:3,32:2:2,128:4:2,128:8:2")
ap.add_argument("--ncu", action="store_true")
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
res = {}
for m in args.models.split(","):
    hq, hkv, dim, layers = SHAPES[m]
    b, page = 256, 16
    for ctx in map(int, args.contexts.split(",")):
        per = -(-ctx // page)
        blocks = b * per + 1
        L = 4 if not args.ncu else 1
        kcs = [torch.randn(blocks, page, hkv, dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(L)]
        vcs = [torch.randn_like(k) for k in kcs]
        tables = torch.randperm(blocks - 1, device=dev, generator=g)[:b * per].view(b, per).int()
        # every row at the same context, as the fixed load's rows are at any one step
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(b, hq, dim, device=dev, dtype=torch.bfloat16, generator=g)
        for cfg in args.configs.split(","):
            bn, nw, ns, sp = (list(map(int, cfg.split(":"))) + [1])[:4]
            run = lambda: [paged_decode(q, kcs[i % L], vcs[i % L], tables, lens, block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp) for i in range(layers)]
            run(); torch.cuda.synchronize()
            if args.ncu:
                torch.cuda.synchronize(); continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            for _ in range(3): graph.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(20):
                e0.record(); graph.replay(); e1.record(); e1.synchronize()
                times.append(e0.elapsed_time(e1) * 1000 / layers)
            times.sort()
            us = times[len(times) // 2]
            nbytes = 2 * b * ctx * hkv * dim * 2
            res[f"{m}_ctx{ctx}_{cfg}"] = {"us_per_layer": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)}
            print(m, ctx, cfg, round(us, 2), "us", round(nbytes / us / 1e6, 3), "TB/s", flush=True)
if args.out:
    json.dump(res, open(args.out, "w"), indent=1)
