"""The decode step's projections at 256 rows inside a CUDA graph (28 launches, four weight copies in turn, so the weights
come from HBM for the larger shapes; the smallest fit in L2 together): cuBLAS `F.linear`, `addmm` with the residual (what the compiled layer runs), linear then add, and
split-K as one batched matmul over K chunks (bf16 or float32 partials, with and without the sum and residual add),
cuBLASLt preferred; microseconds per launch and the error against float64.

    python bench/decode_split_k.py --out out.json
"""
import json, argparse
import torch
import torch.nn.functional as F
ap = argparse.ArgumentParser(); ap.add_argument("--out"); args = ap.parse_args()
dev = "cuda"
SH = {"0.5b_down": (4864, 896), "1.5b_down": (8960, 1536), "0.5b_o": (896, 896), "1.5b_o": (1536, 1536),
      "1.5b_gate_up": (1536, 17920), "0.5b_gate_up": (896, 9728), "7b_down": (18944, 3584)}
M = 256
res = {}
def timed(fn, n=28):
    for _ in range(2): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(30):
        e0.record(); g.replay(); e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1000 / n)
    ts.sort(); return round(ts[len(ts) // 2], 2)
for name, (K, N) in SH.items():
    Ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** .5 for _ in range(4)]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    r = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    ref = (x.double() @ Ws[0].double().t() + r.double())
    row = {}
    def err(y): return float((y.double() - ref).norm() / ref.norm())
    row["linear"] = timed(lambda: [F.linear(x, Ws[i % 4]) for i in range(28)])
    row["addmm"] = timed(lambda: [torch.addmm(r, x, Ws[i % 4].t()) for i in range(28)])
    row["linear+add"] = timed(lambda: [F.linear(x, Ws[i % 4]) + r for i in range(28)])
    row["err_addmm"] = err(torch.addmm(r, x, Ws[0].t()))
    for S in (2, 3, 4, 8):
        if K % S: continue
        def split(i, S=S):
            W = Ws[i % 4]
            a = x.view(M, S, K // S).transpose(0, 1)
            b = W.view(N, S, K // S).permute(1, 2, 0)
            return torch.bmm(a, b)
        row[f"bmm_split{S}"] = timed(lambda S=S: [split(i, S) for i in range(28)])
        row[f"bmm_split{S}+sum+add"] = timed(lambda S=S: [split(i, S).sum(0) + r for i in range(28)])
        row[f"err_split{S}"] = err(split(0).float().sum(0) + r.float())
        try:
            def split32(i, S=S):
                W = Ws[i % 4]
                a = x.view(M, S, K // S).transpose(0, 1)
                b = W.view(N, S, K // S).permute(1, 2, 0)
                return torch.bmm(a, b, out_dtype=torch.float32)
            row[f"bmm32_split{S}"] = timed(lambda S=S: [split32(i, S) for i in range(28)])
            row[f"err32_split{S}"] = err(split32(0).sum(0) + r.float())
        except Exception as e:
            row["bmm32"] = str(e)[:100]
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["lt_linear"] = timed(lambda: [F.linear(x, Ws[i % 4]) for i in range(28)])
        row["lt_addmm"] = timed(lambda: [torch.addmm(r, x, Ws[i % 4].t()) for i in range(28)])
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    flops = 2 * M * K * N
    row["tflops_linear"] = round(flops / row["linear"] / 1e6, 1)
    res[name] = row
    print(name, json.dumps(row), flush=True)
json.dump(res, open(args.out, "w"), indent=1)
