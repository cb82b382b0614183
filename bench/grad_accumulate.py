"""A micro-batch's gradient accumulation on one GPU (issue 48): fp32 buffer += bf16 gradient for every parameter of a
Qwen2.5 shape, PyTorch's `add_` (its mixed-dtype elementwise path) against `lathe.train.accumulate.accumulate_` (the
vectorized Triton kernel for tensors of at least MIN_NUMEL elements, add_ below), and the kernel forced on every
tensor (`kernel_all`: the host's launch cost where tensors are small).

    python bench/grad_accumulate.py [--shapes 1.5b,7b] [--out bench/results/grad_accumulate_<device>.json]

Each figure is the mean over 5 passes (after 2 warm-up passes) of one pass over all parameters, with the bytes an
element needs (4 read + 2 read + 4 written) over that time.
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

from common import SHAPES, device_name, git_sha, print_and_write, slug  # noqa: E402
from lathe.train.accumulate import MIN_NUMEL, accumulate_, launch  # noqa: E402


def parameter_shapes(shape: dict) -> list[tuple[int, ...]]:
    """Every parameter of a dense Qwen2 shape: embedding (and an untied head), per layer q/k/v/o (q/k/v biases),
    gate/up/down and two norms, the final norm."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (kv,), (kv,), (h,), (h,)]
    return [(v, h), *layer * shape["num_hidden_layers"], (h,)] + ([] if shape["tie_word_embeddings"] else [(v, h)])


def time_pass(fn, accs, grads, iters: int = 5) -> float:
    for _ in range(2):
        for a, g in zip(accs, grads):
            fn(a, g)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        for a, g in zip(accs, grads):
            fn(a, g)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1.5b,7b")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    name = device_name(device)
    result = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "min_numel": MIN_NUMEL, "shapes": {}}
    for shape_name in args.shapes.split(","):
        shapes = parameter_shapes(SHAPES[shape_name])
        accs = [torch.randn(s, device=device) for s in shapes]
        grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
        numel = sum(a.numel() for a in accs)
        row = {"parameters": len(shapes), "numel": numel,
               "kernel_tensors": sum(a.numel() >= MIN_NUMEL for a in accs)}
        for label, fn in (("add_", lambda a, g: a.add_(g)), ("accumulate_", accumulate_), ("kernel_all", launch)):
            s = time_pass(fn, accs, grads)
            row[f"{label}_ms"] = s * 1e3
            row[f"{label}_tb_per_s"] = numel * 10 / s / 1e12
        result["shapes"][shape_name] = row
        print(shape_name, json.dumps(row), flush=True)
        del accs, grads
        torch.cuda.empty_cache()
    print_and_write(result, args.out or str(ROOT / "bench" / "results" / f"grad_accumulate_{slug(name)}.json"))


if __name__ == "__main__":
    main()
