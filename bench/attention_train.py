"""Training attention, forward and backward, on the packed backends lathe's decoder can train with: torch's flash
attention 2 (`varlen`, the default) and flash-attn-4's CuTe kernels (`fa4`, `override_config.attn_implementation=
flash_attention_4`).

    python bench/attention_train.py [--shapes 0.5b,1.5b,7b] [--loads fixed768,random256-768] [--tokens 12288]
                                    [--out FILE]

For each model shape's attention (query and KV heads, head dim) and each load (a micro-batch of about `--tokens`
packed tokens: sequences all at the e2e bench's 768 tokens, or lengths drawn between 256 and 768 as a real batch has
them; longer loads, `fixed4352` say, hold fewer sequences), the backend's forward and its forward + backward through
`lathe.models.attention.PackedAttention` (what the decoder's layers call), timed with CUDA events over `--reps` calls
(median), and the causal FLOPs per second (forward 4 x Hq x D x the causal pairs, backward 2.5x that). Correctness
first: each backend's output and q/k/v gradients against float64 SDPA per sequence (norm-relative error), and a
segment with fewer queries than keys (the prefix-grouped forward's layout, `GroupedAttention`) against SDPA with the
mask aligned at its end (sequences up to 4608 tokens). Writes JSON (device, date, git sha) to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_name, git_sha  # noqa: E402

from lathe.models.attention import GroupedAttention, PackedAttention, causal_at_end  # noqa: E402

HEADS = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def lengths_for(load: str, tokens: int, gen: torch.Generator) -> list[int]:
    """A micro-batch of about `tokens` tokens: `fixedN` (sequences of N tokens) or `randomA-B` (lengths drawn
    uniformly in [A, B]), as many sequences as `tokens` holds at the longest length (at least one)."""
    if load.startswith("fixed"):
        n = int(load[len("fixed"):])
        return [n] * max(1, tokens // n)
    lo, hi = (int(x) for x in load[len("random"):].split("-"))
    cpu = torch.Generator().manual_seed(gen.initial_seed())
    return torch.randint(lo, hi + 1, (max(1, tokens // hi),), generator=cpu).tolist()


def packed(lengths: list[int], heads: tuple[int, int, int], device, gen: torch.Generator):
    hq, hkv, d = heads
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device=device, generator=gen, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def reference(q, k, v, bounds_q, bounds_k, grad):
    """float64 SDPA per segment (queries the last of their keys): output and q/k/v gradients."""
    qq, kk, vv = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b, c, e in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        qs = qq[a:b].transpose(0, 1)
        ks, vs = (x[c:e].transpose(0, 1).repeat_interleave(groups, 0) for x in (kk, vv))
        mask = causal_at_end(b - a, e - c, q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    out = torch.cat(outs)
    return [out, *torch.autograd.grad(out, (qq, kk, vv), grad.double())]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


def check(attn, q, k, v, bounds_q, bounds_k, gen) -> dict:
    grad = torch.randn(q.shape, device=q.device, generator=gen, dtype=q.dtype)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = attn(qq, kk, vv)
    got = [out, *torch.autograd.grad(out, (qq, kk, vv), grad)]
    want = reference(q, k, v, bounds_q, bounds_k, grad)
    return {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def run_case(shape: str, load: str, backend: str, tokens: int, reps: int, gen: torch.Generator) -> dict:
    dev = torch.device("cuda")
    heads = HEADS[shape]
    lengths = lengths_for(load, tokens, gen)
    q, k, v, cu = packed(lengths, heads, dev, gen)
    attn = PackedAttention(cu, max(lengths), backend)
    bounds = cu.tolist()
    t0 = time.perf_counter()
    errors = check(attn, q, k, v, bounds, bounds, gen) if max(lengths) <= 4608 else None   # (float64 SDPA: L^2)
    first_s = time.perf_counter() - t0          # the first calls compile fa4's kernels
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    grad = torch.randn(q.shape, device=dev, generator=gen, dtype=q.dtype)

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwd_bwd():
        out = attn(qq, kk, vv)
        torch.autograd.grad(out, (qq, kk, vv), grad)

    fwd_s, fwd_bwd_s = timed(fwd, reps), timed(fwd_bwd, reps)
    hq, _, d = heads
    fwd_flops = 4 * hq * d * sum(n * (n + 1) // 2 for n in lengths)
    return {"shape": shape, "load": load, "backend": backend, "seqs": len(lengths), "tokens": sum(lengths),
            "rel_err_vs_float64": errors, "first_call_s": first_s, "fwd_ms": fwd_s * 1e3,
            "fwd_bwd_ms": fwd_bwd_s * 1e3, "fwd_tflops": fwd_flops / fwd_s / 1e12,
            "fwd_bwd_tflops": 3.5 * fwd_flops / fwd_bwd_s / 1e12}


def at_end_case(shape: str, backend: str, gen: torch.Generator) -> dict:
    """Segments with fewer queries than keys (the prefix-grouped forward's): the keys gathered from the stream."""
    dev = torch.device("cuda")
    hq, hkv, d = HEADS[shape]
    q_lens, k_lens = [64, 200, 1], [320, 200, 129]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), hq, d, device=dev, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), hkv, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    index = torch.arange(sum(k_lens), device=dev)
    attn = GroupedAttention(cu_q, cu_k, index, max(q_lens), max(k_lens), backend)
    return {"shape": shape, "backend": backend, "q_lens": q_lens, "k_lens": k_lens,
            "rel_err_vs_float64": check(attn, q, k, v, cu_q.tolist(), cu_k.tolist(), gen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b,1.5b,7b")
    ap.add_argument("--loads", default="fixed768,random256-768")
    ap.add_argument("--backends", default="varlen,fa4")
    ap.add_argument("--tokens", type=int, default=12288, help="tokens per micro-batch (16 x 768: the e2e bench's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    results, at_end, failures = [], [], []
    for shape in args.shapes.split(","):
        for backend in args.backends.split(","):
            try:
                at_end.append(at_end_case(shape, backend, torch.Generator("cuda").manual_seed(1)))
                print(json.dumps(at_end[-1]), flush=True)
                for load in args.loads.split(","):
                    r = run_case(shape, load, backend, args.tokens, args.reps, torch.Generator("cuda").manual_seed(0))
                    results.append(r)
                    print(json.dumps(r), flush=True)
            except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others' figures
                failures.append({"shape": shape, "backend": backend, "error": f"{type(e).__name__}: {e}"[:2000]})
                print(json.dumps(failures[-1]), flush=True)
    doc = {"what": "bench/attention_train.py: packed causal training attention, forward and forward+backward, flash "
                   "attention 2 (varlen) against flash-attn-4 (fa4)", "device": device_name(torch.device("cuda")),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "results": results, "at_end": at_end, "failures": failures}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
