"""The decode step's layers with o_proj and down_proj as split-K matmuls (`DecoderLayer.split_forward`) against the
layers' plain forward, as the engine runs them: random-weight Qwen2.5 shapes in bf16, projections fused, layers
compiled (inductor), the whole decoder (embedding, every layer, final norm) replayed in a CUDA graph at each batch
of `--rows`. The attention is a stub (it hands q back), so what is timed is everything of the step but attention,
lm_head and sampling; the splits change nothing else.

    python bench/decode_split_layers.py [--models 0.5b,1.5b] [--rows 256,128,64] [--splits-o 1,2] [--splits-down 1,2,4]

Per model and rows: microseconds per step of the plain forward and of every (o, down) split pair (median of
`--reps` timed replays of 20 steps), the norm-relative error of each against the plain forward's hidden states,
the error of each and of the plain bf16 forward against the same weights in float32 (plain forward, eager),
the engine's own choice (`step_split_k`), and torch.profiler kernel tables of the plain step and the engine's
choice at the largest row count. Writes JSON (device, date, git sha) to `--out`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import SHAPES, build_hf, graph_step_us, result_header, summarize_profile, write_result  # noqa: E402

from lathe.engine.model_runner import step_split_k  # noqa: E402
from lathe.models.compile import compile_decoder  # noqa: E402
from lathe.models.decoder import fuse_projections  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402


class StubAttention:
    """Hands q back as the attention's output: the layers' own work, without the KV cache."""
    rotates = False

    def __init__(self, split_k):
        self.split_k = split_k

    def __call__(self, q, k, v):
        return q


def kernel_table(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            fn()
        torch.cuda.synchronize()
    return summarize_profile(prof, torch.device("cuda"), top=16)


def bench_model(name: str, args) -> dict:
    device = torch.device("cuda")
    hf = build_hf(name, device, torch.bfloat16).eval()
    model = lathe_from_transformers(hf).eval()
    exact = lathe_from_transformers(hf.float()).eval()      # the same weights in float32, plain forward, eager
    del hf
    fuse_projections(model)
    compile_decoder(model)
    cfg = model.config
    out = {"shape": SHAPES[name], "rows": {}}
    pairs = [(o, d) for o in args.splits_o for d in args.splits_down
             if (cfg.num_attention_heads * cfg.head_dim) % o == 0 and cfg.intermediate_size % d == 0]
    for rows in args.rows:
        gen = torch.Generator(device="cpu").manual_seed(rows)
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen).to(device)
        pos = torch.randint(0, 1024, (rows,), generator=gen).to(device)
        row = {"engine_choice": step_split_k(model, rows)}
        with torch.inference_mode():
            ref = model.model(ids, pos, StubAttention(None)).float()
            f32 = exact.model(ids, pos, StubAttention(None))
            row["plain_rel_err_vs_fp32"] = float((ref - f32).norm() / f32.norm())

            def run(split):
                return lambda: model.model(ids, pos, StubAttention(split))
            row["plain_us"] = graph_step_us(run(None), args.reps)
            for pair in pairs:
                got = model.model(ids, pos, StubAttention(pair)).float()
                row[f"split_{pair[0]}_{pair[1]}"] = {"us": graph_step_us(run(pair), args.reps),
                                                     "rel_err": float((got - ref).norm() / ref.norm()),
                                                     "rel_err_vs_fp32": float((got - f32).norm() / f32.norm())}
            if rows == max(args.rows):
                row["kernels_plain_8_steps"] = kernel_table(run(None))
                if row["engine_choice"] is not None:
                    row["kernels_engine_choice_8_steps"] = kernel_table(run(row["engine_choice"]))
        timed = {k: v["us"] for k, v in row.items() if k.startswith("split_")}
        best = min(timed, key=timed.get)
        row["best"] = {"pair": best, "us": timed[best], "vs_plain": timed[best] / row["plain_us"]}
        out["rows"][rows] = row
        print(name, rows, f"plain {row['plain_us']:.1f} us", {k: round(v, 1) for k, v in timed.items()},
              "engine", row["engine_choice"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--rows", default="256,128,64")
    ap.add_argument("--splits-o", default="1,2")
    ap.add_argument("--splits-down", default="1,2,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for key in ("rows", "splits_o", "splits_down"):
        setattr(args, key, [int(x) for x in getattr(args, key).split(",")])
    torch._dynamo.config.recompile_limit = 256        # every split pair is a compiled variant of the same code
    torch._dynamo.config.accumulated_recompile_limit = 4096
    res = result_header("decode_split_layers", torch.device("cuda"), args, models={})
    for name in args.models.split(","):
        res["models"][name] = bench_model(name, args)
        write_result(res, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
