"""Causal attention over packed sequences (`PackedAttention`'s varlen path: the engine's prefill and the trainer's
forward and backward) on the backends PyTorch has: flash attention (what lathe runs, `varlen_attn`) against cuDNN's
ragged (THD) attention through `aten._cudnn_attention_forward`/`_backward`, which `varlen_attn` has behind a
switch it keeps off, and cuDNN/flash SDPA on a dense batch where every sequence has the same length.

    python bench/varlen_backends.py [--models 0.5b,1.5b] [--out bench/results/varlen_backends_<device>.json]

Per model (its heads and head size) and layout (`--layouts`: the fixed load's prefill step, 64 prompts of 256
tokens; a grpo prefill step of 64 random lengths in 64..512; a training micro-batch of 32 sequences of 256..768
tokens), bf16: milliseconds per call of the forward (and forward + backward with `--backward`), median of `--reps`
calls, each call with other sequence lengths of the same layout (so a backend that plans per set of lengths pays for
it), TFLOP/s of the causal attention, and the norm-relative error against flash's output. cuDNN's ragged path takes
no GQA: its K/V are repeated to the query heads (the repeat is timed with it).

Answer on an H100 (varlen_backends_nvidia-h100-80gb-hbm3.json, torch 2.11): keep flash. cuDNN's ragged path builds a
plan per set of lengths (41-130 ms a call when they change); on equal lengths dense cuDNN is no faster than flash.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from decode_gemms import MODELS  # noqa: E402
from train import result_header, write_result  # noqa: E402

LAYOUTS = {"fixed_prefill": (64, 256, 256), "grpo_prefill": (64, 64, 512), "train_micro": (32, 256, 768)}


def lengths(layout: str, seed: int) -> list[int]:
    n, lo, hi = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def flash(q, k, v, cu, mx):
    """lathe's own varlen path (`PackedAttention`, as the engine's prefill and the trainer call it)."""
    from lathe.models.attention import PackedAttention
    return PackedAttention(cu, mx, "varlen")(q, k, v)


def cudnn_ragged(q, k, v, cu, mx):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False)[0]


def dense(backend, repeat_kv: bool):
    """SDPA on a (B, H, L, D) batch, one backend allowed; K/V repeated to the query heads where it takes no GQA."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, cu, mx):
        b = cu.numel() - 1
        shape = (b, mx, -1, q.shape[-1])
        if repeat_kv:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        qd, kd, vd = (x.view(shape).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=qd.shape[1] != kd.shape[1])
        return out.transpose(1, 2).reshape(q.shape)
    return run


def inputs(lens, hq, hkv, d, device, backward):
    t = sum(lens)
    g = torch.Generator(device=device).manual_seed(len(lens) + t)
    q, k, v = (torch.randn(t, h, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(backward)
               for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + lens, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, cu, max(lens)


def time_backend(fn, layout, hq, hkv, d, args, equal_only=False) -> dict:
    device = torch.device("cuda")
    times, flops = [], []
    for rep in range(args.reps + 2):
        lens = lengths(layout, rep)
        if equal_only and len(set(lens)) > 1:
            return {"skipped": "a dense batch needs equal lengths"}
        q, k, v, cu, mx = inputs(lens, hq, hkv, d, device, args.backward)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q, k, v, cu, mx)
        if args.backward:
            out.backward(torch.ones_like(out))
        end.record()
        end.synchronize()
        if rep >= 2:                               # the first two: warm-up (a plan or a kernel compiled)
            times.append(start.elapsed_time(end))
            flops.append(sum(2 * 2 * n * (n + 1) / 2 * d * hq for n in lens) * (3.5 if args.backward else 1))
    ms = statistics.median(times)
    return {"ms": round(ms, 4), "ms_all": [round(t, 4) for t in times],
            "tflops": round(statistics.median(flops) / ms / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend
    backends = {"flash_varlen": flash, "cudnn_ragged": cudnn_ragged,
                "cudnn_dense": dense(SDPBackend.CUDNN_ATTENTION, True),
                "flash_dense": dense(SDPBackend.FLASH_ATTENTION, False)}
    res = result_header("varlen_backends", torch.device("cuda"), args, models={})
    for name in args.models.split(","):
        _, _, hq, hkv, d, _ = MODELS[name]
        for layout in args.layouts.split(","):
            row = {}
            q, k, v, cu, mx = inputs(lengths(layout, 0), hq, hkv, d, torch.device("cuda"), False)
            ref = flash(q, k, v, cu, mx).float()
            for bname, fn in backends.items():
                try:
                    row[bname] = time_backend(fn, layout, hq, hkv, d, args, equal_only=bname.endswith("_dense"))
                    if "ms" in row[bname]:
                        got = fn(q, k, v, cu, mx).float()
                        row[bname]["rel_err_vs_flash"] = float((got - ref).norm() / ref.norm())
                except Exception as e:           # a backend that cannot take the shape: recorded, not fatal
                    row[bname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["models"].setdefault(name, {})[layout] = row
            print(name, layout, {b: r.get("ms", r.get("skipped", r.get("error", ""))[:60]) for b, r in row.items()},
                  flush=True)
            write_result(res, args.out)


if __name__ == "__main__":
    main()
