"""Probe: Mamba2's scan at Nemotron-Nano's shapes, lathe's torch chunk_scan against fla's chunk_simple_gla
(q = C, k = B, v = dt x, g = dt A, scale 1, state (P, N)), forward and forward+backward, bf16 inputs; and their
agreement (norm-relative). Writes JSON to argv[1]."""
import json
import sys
import time

import torch


torch.manual_seed(0)
dev = "cuda"
H, P, G, N = 64, 64, 8, 128
lengths = [768] * 32          # a micro-batch of e2e's shape (256 + 512 tokens)
T = sum(lengths)
cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=dev, dtype=torch.int32)
x = torch.randn(T, H, P, device=dev, dtype=torch.bfloat16)
B = torch.randn(T, G, N, device=dev, dtype=torch.bfloat16) * 0.3
C = torch.randn(T, G, N, device=dev, dtype=torch.bfloat16) * 0.3
dt = torch.nn.functional.softplus(torch.randn(T, H, device=dev) - 2)
A = -torch.rand(H, device=dev).mul(4).add(0.5)
D = torch.ones(H, device=dev)
leaves = [t.clone().requires_grad_() for t in (x, B, C, dt)]


from lathe.models import linear_attention as la  # noqa: E402
from lathe.models import ssd  # noqa: E402

out = {"device": torch.cuda.get_device_name(), "shape": dict(H=H, P=P, G=G, N=N, T=T, seqs=len(lengths)),
       "broken_triton": la._broken_triton(torch.device(dev)), "lift": la._lift_fla_guard()}
t0 = time.perf_counter()
out["layout_check"] = ssd._layout_ok(torch.device(dev), H, N, P, torch.bfloat16, torch.float32)
out["layout_check_s"] = time.perf_counter() - t0
print("check", out["layout_check"], out["layout_check_s"], flush=True)


def torch_form(x, B, C, dt):
    return ssd.torch_scan(x, dt, A, B, C, cu, max(lengths), D=D)[0]


def fla_form(x, B, C, dt):
    return ssd._fla_scan(x, dt, A, B, C, cu, D, None)[0]


def timed(fn, backward, reps=10):
    for _ in range(3):
        y = fn(*leaves)
        if backward:
            y.float().square().mean().backward()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        y = fn(*leaves)
        if backward:
            y.float().square().mean().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def grads(fn):
    for t in leaves:
        t.grad = None
    y = fn(*leaves)
    y.float().square().mean().backward()
    return y.detach().float(), [t.grad.float().clone() for t in leaves]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
y64 = ssd.torch_scan(ref_leaves[0], ref_leaves[3], A.double(), ref_leaves[1], ref_leaves[2], cu, max(lengths),
                 D=D.double())[0]
y64.square().mean().backward()
g64 = [t.grad for t in ref_leaves]
for name, fn in (("torch_scan", torch_form), ("fla_scan", fla_form)):
    try:
        y, g = grads(fn)
        out[name] = {"fwd_ms": timed(fn, False), "fwd_bwd_ms": timed(fn, True),
                     "err_y_vs_fp64": rel(y.double(), y64.detach()),
                     "err_grads_vs_fp64": [rel(a.double(), b) for a, b in zip(g, g64)]}
    except Exception as e:          # noqa: BLE001
        out[name] = {"failed": repr(e)[:400]}
    print(name, out[name], flush=True)
out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
json.dump(out, open(sys.argv[1], "w"), indent=1)
