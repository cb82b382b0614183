"""Mamba2's scan (Nemotron-H's linear layers) on one GPU: the torch form against fla's `chunk_simple_gla`, as
`lathe.models.ssd` runs them (`torch_scan`, `_fla_scan`), at Nemotron-3-Nano's layout.

    python bench/ssd_scan.py [--out bench/results/ssd_scan_<device>.json]

One micro-batch of `bench/e2e.py`'s shape (32 packed sequences of 768 tokens), 64 heads of 64 with 8 groups of B and
C of 128, x, B and C in bf16, dt and A in float32 (what the mixer hands the scan in a bf16 update):
- `check`: fla's layout check (`ssd._layout_ok`, what lifts fla's refusal of this backward on Hopper with Triton
  3.4 .. 3.7.0, fla #640), timed: on a machine where fla has not run yet it includes compiling and autotuning;
- per form: forward and forward + backward milliseconds (wall, after warm-up), and the output's and the gradients'
  (x, B, C, dt) norm-relative error against the torch form in float64;
- `initial_state`: fla's forward from given states (the engine's prefills) against the torch form's, output and
  final states, on packed sequences of 1, 64, 300 and 777 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_name, git_sha, slug  # noqa: E402
from lathe.models import linear_attention as la  # noqa: E402
from lathe.models import ssd  # noqa: E402

H, P, G, N = 64, 64, 8, 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def timed(fn, leaves, backward: bool, reps: int = 10) -> float:
    for _ in range(3):
        y = fn(*leaves)
        if backward:
            y.float().square().mean().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        y = fn(*leaves)
        if backward:
            y.float().square().mean().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def forms(dev: torch.device) -> dict:
    torch.manual_seed(0)
    lengths = [768] * 32
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    t = sum(lengths)
    leaves = [torch.randn(t, H, P, device=dev, dtype=torch.bfloat16),
              (torch.randn(t, G, N, device=dev) * 0.3).bfloat16(), (torch.randn(t, G, N, device=dev) * 0.3).bfloat16(),
              torch.nn.functional.softplus(torch.randn(t, H, device=dev) - 2)]
    leaves = [x.requires_grad_() for x in leaves]
    A, D = -torch.rand(H, device=dev).mul(4).add(0.5), torch.ones(H, device=dev)
    fns = {"torch_scan": lambda x, B, C, dt: ssd.torch_scan(x, dt, A, B, C, cu, max(lengths), D=D)[0],
           "fla_scan": lambda x, B, C, dt: ssd._fla_scan(x, dt, A, B, C, cu, D, None)[0]}
    exact = [x.detach().double().requires_grad_() for x in leaves]
    want = ssd.torch_scan(exact[0], exact[3], A.double(), exact[1], exact[2], cu, max(lengths), D=D.double())[0]
    want.square().mean().backward()
    out = {"shape": dict(heads=H, head_dim=P, groups=G, state=N, tokens=t, sequences=len(lengths))}
    for name, fn in fns.items():
        for x in leaves:
            x.grad = None
        y = fn(*leaves)
        y.float().square().mean().backward()
        # the errors before the timing, whose backward passes add into the same .grad
        errors = {"err_y_vs_fp64": rel(y.detach(), want.detach()),
                  "err_grads_vs_fp64": {n: rel(x.grad, e.grad) for n, x, e in zip(("x", "B", "C", "dt"), leaves,
                                                                                 exact)}}
        out[name] = {"fwd_ms": timed(fn, leaves, False), "fwd_bwd_ms": timed(fn, leaves, True), **errors}
        print(name, out[name], flush=True)
    return out


def initial_state(dev: torch.device) -> dict:
    torch.manual_seed(0)
    lengths = [1, 64, 300, 777]
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    x = torch.randn(t, H, P, device=dev, dtype=torch.bfloat16)
    B, C = ((torch.randn(t, G, N, device=dev) / N ** 0.5).bfloat16() for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(t, H, device=dev) - 2)
    A, D = -torch.rand(H, device=dev).mul(4).add(0.5), torch.randn(H, device=dev)
    h0 = torch.randn(len(lengths), H, P, N, device=dev)
    out = {}
    with torch.inference_mode():
        for name, init in (("zero", None), ("given", h0)):
            y, final = ssd._fla_scan(x, dt, A, B, C, cu, D, init)
            want_y, want_final = ssd.torch_scan(x.float(), dt, A, B.float(), C.float(), cu, max(lengths), D=D,
                                                initial_state=init)
            out[name] = {"err_y": rel(y, want_y), "err_final_state": rel(final, want_final)}
            print("initial state", name, out[name], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    if ssd.fla_scan() is None:
        sys.exit("flash-linear-attention is not installed (pip install 'lathe[hybrid]')")
    result = {"device": device_name(dev), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "git_sha": git_sha(), "torch": torch.__version__, "broken_triton": la._broken_triton(dev),
              "lift": la._lift_fla_guard()}
    start = time.perf_counter()
    result["check"] = ssd._layout_ok(dev, H, N, P, torch.bfloat16, torch.float32)
    result["check_s"] = time.perf_counter() - start
    result.update(forms(dev))
    result["initial_state"] = initial_state(dev)
    out = Path(args.out or ROOT / "bench" / "results" / f"ssd_scan_{slug(result['device'])}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
