"""Reward-model scoring throughput: lathe's packed forward against transformers' padded forward, same rows (issue 46).

    python bench/rm.py [--shape 1.5b] [--rows 512] [--prompt-len 256] [--max-response 512] [--git-sha SHA]
                       [--out bench/results/rm_<device>.json]
    python bench/rm.py --shape tiny --device cpu --rows 12 --prompt-len 8 --max-response 24 --out /tmp/rm.json
    python bench/rm.py --shape tiny --device cpu --dtype bfloat16 --rows 8 --prompt-len 64 --max-response 192 ...

A random-weight Qwen2.5-shape `Qwen2ForSequenceClassification` (one label; bench/common.py's shapes, default 1.5B),
bf16 on the GPU (float32 on the CPU; `--dtype` chooses), its RoPE frequencies kept in float32 as `from_pretrained`
keeps them (`cast_keeping_rope`: rounded to bf16, they made transformers' bf16 model and the float32 reference made
from it another model than lathe's decoder, whose frequencies are float32: issue 46), scores `--rows` rows of
`--prompt-len` prompt tokens and 0..`--max-response` response tokens twice in one call, through the reward-model
worker's own code (`lathe.workers.reward_model`):

* lathe: the checkpoint's tensors in lathe's decoder (`select_reward_impl`, shared, not copied), each micro-batch one
  packed forward (no padding) and the score head at each row's last token;
* transformers: the same model, each micro-batch padded on the right to its longest row (the worker's fallback).

Both split the rows as the worker does (`rm_micro_batches`: `--max-tokens` tokens per forward as
`reward_model.use_dynamic_bsz` with `forward_max_token_len_per_gpu`, or `--micro-batch` rows when `--max-tokens 0`).
Each runs one untimed pass, then `--repeats` timed passes (the best counts). tokens/s counts real tokens only (the
same number for both). In float32 the two score vectors must agree (norm-relative error under `--rel`); in bf16 the
two paths round differently, so `--fp32-rows` rows are scored by transformers in float32 too and lathe's scores must
be no further from those than 1.5 times transformers' bf16 scores are (or `--rel`). The JSON is written either way
and says `agree`; the command exits non-zero when they do not.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DENSE_SHAPES, ROOT, SHAPES, cast_keeping_rope, device_name, git_sha,  # noqa: E402
                    random_prompts, slug, sync)

from lathe.workers.reward_model import rm_micro_batches, score_rows, select_reward_impl  # noqa: E402


FP32_FACTOR = 1.5      # in bf16, lathe's scores may lie at most this many times as far from float32's as transformers'


def build_rm(shape: str, device: torch.device, dtype: torch.dtype):
    """A random `Qwen2ForSequenceClassification` of `shape`, one label, its score head of order-1 outputs, its RoPE
    frequencies float32 (`cast_keeping_rope`)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      num_labels=1, pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForSequenceClassification(cfg)
        torch.nn.init.normal_(model.score.weight, std=cfg.hidden_size ** -0.5)
    return cast_keeping_rope(model, dtype).eval().requires_grad_(False)


def sdpa_kernels(names: str | None):
    """`torch.nn.attention.sdpa_kernel` over the named backends (None: PyTorch's own choice)."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    table = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([table[n] for n in names.split(",")])


def timed(fn, device, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()                                                  # untimed: kernels, allocator
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    hf = build_rm(args.shape, device, dtype)
    lathe, packed, impl = select_reward_impl(hf, "lathe")
    lathe.attn_backend = args.lathe_attention
    built_s = time.perf_counter() - start
    prompts = random_prompts(args.rows, args.prompt_len, args.prompt_len, SHAPES[args.shape]["vocab_size"], 0)
    responses = random_prompts(args.rows, 0, args.max_response, SHAPES[args.shape]["vocab_size"], 1)
    rows = [p + r for p, r in zip(prompts, responses)]
    lengths = [len(r) for r in rows]
    rm_cfg = SimpleNamespace(use_dynamic_bsz=args.max_tokens > 0, forward_max_token_len_per_gpu=args.max_tokens)
    parts = rm_micro_batches(lengths, rm_cfg, args.micro_batch)
    tokens = sum(lengths)
    padded = sum(len(p) * max(lengths[i] for i in p) for p in parts)
    result = {"impl": impl, "packed_attention": lathe.packed_backend(), "build_s": round(built_s, 2)}
    scores = {}
    for name, model, is_packed in (("lathe", lathe, packed), ("transformers", hf, False)):
        run_once = lambda: score_rows(model, is_packed, rows, parts, device, 0)       # noqa: E731
        with sdpa_kernels(args.sdpa_kernels):
            seconds, scores[name] = timed(run_once, device, args.repeats)
        result[name] = {"seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
        if device.type == "cuda":
            result[name]["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
            torch.cuda.reset_peak_memory_stats(device)
    ref = scores["transformers"].double()
    err = ((scores["lathe"].double() - ref).norm() / ref.norm()).item()
    result.update(ratio=round(result["lathe"]["tokens_per_s"] / result["transformers"]["tokens_per_s"], 3),
                  rel_err=err, tokens=tokens, padded_tokens=padded, micro_batches=len(parts),
                  score_std=scores["transformers"].std().item(), agree=err <= args.rel)
    if dtype != torch.float32 and args.fp32_rows > 0:
        # in bf16 both paths round differently (kernels, summation order): which one is nearer the float32 scores?
        sub = list(range(min(args.fp32_rows, len(rows))))
        hf.float()                  # (lathe's decoder holds its own bf16 tensors: load_into made new parameters)
        exact = score_rows(hf, False, [rows[i] for i in sub],
                           rm_micro_batches([lengths[i] for i in sub], rm_cfg, args.micro_batch), device, 0).double()
        result["rel_err_vs_fp32"] = {name: ((got[sub].double() - exact).norm() / exact.norm()).item()
                                     for name, got in scores.items()}
        result["fp32_rows"] = len(sub)
        near = result["rel_err_vs_fp32"]
        result["agree"] = near["lathe"] <= max(args.rel, FP32_FACTOR * near["transformers"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1.5b", choices=DENSE_SHAPES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="the models' dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-response", type=int, default=512, help="responses of 0..this many tokens (uniform)")
    p.add_argument("--max-tokens", type=int, default=16384,
                   help="tokens per forward (reward_model.use_dynamic_bsz, forward_max_token_len_per_gpu); 0 = "
                        "--micro-batch rows per forward")
    p.add_argument("--micro-batch", type=int, default=32, help="rows per forward with --max-tokens 0")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fp32-rows", type=int, default=128,
                   help="in bf16: score this many rows with transformers in float32 too, and judge the agreement by "
                        "each path's distance from those (lathe's at most 1.5 times transformers', or --rel)")
    p.add_argument("--lathe-attention", default="auto", choices=("auto", "varlen", "sdpa"),
                   help="lathe's packed attention kernel (auto: flash-attention varlen on CUDA in bf16)")
    p.add_argument("--sdpa-kernels", default=None,
                   help="comma list of SDPA backends (flash, efficient, cudnn, math) both paths may use, e.g. math: "
                        "lathe's `--lathe-attention sdpa` otherwise takes flash (no mask) where transformers' padded "
                        "forward, with its mask, takes another kernel")
    p.add_argument("--rel", type=float, default=None,
                   help="the scores' allowed norm-relative difference (default 0.05 in bf16, 1e-4 in float32); in "
                        "bf16 the floor of lathe's allowed distance from the float32 scores")
    p.add_argument("--git-sha", default=None,
                   help="the commit measured, as your checkout names it (the GPU copy of the tree may lack .git)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    if args.rel is None:
        args.rel = 1e-4 if args.dtype == "float32" else 0.05
    name = device_name(device)
    import transformers
    results = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__,
               "transformers_version": transformers.__version__, "command": " ".join(sys.argv),
               "workload": {k: getattr(args, k) for k in ("shape", "rows", "prompt_len", "max_response", "max_tokens",
                                                          "micro_batch", "repeats", "lathe_attention", "sdpa_kernels")}}
    results.update(run(args))
    out = Path(args.out or ROOT / "bench" / "results" / f"rm_{slug(name)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"{args.shape} RM, {results['tokens']} tokens in {results['micro_batches']} micro-batches on {name}: lathe "
          f"packed {results['lathe']['tokens_per_s']:,.0f} tok/s, transformers padded "
          f"{results['transformers']['tokens_per_s']:,.0f} tok/s (x{results['ratio']}), scores differ by "
          f"{results['rel_err']:.2g} (norm-relative)\nwrote {out}")
    near = results.get("rel_err_vs_fp32")
    if near:
        print(f"against float32 scores of {results['fp32_rows']} rows: lathe {near['lathe']:.2g}, transformers "
              f"{near['transformers']:.2g} (norm-relative)")
    if not results["agree"]:
        why = (f"lathe's distance from the float32 scores {near['lathe']:.3g} > max(--rel {args.rel}, "
               f"{FP32_FACTOR} x transformers' {near['transformers']:.3g})" if near else
               f"norm-relative difference {results['rel_err']:.3g} > --rel {args.rel}")
        raise SystemExit(f"lathe's and transformers' scores differ: {why}")


if __name__ == "__main__":
    main()
