"""`lathe sft` itself against TRL's SFTTrainer on the same supervised workload, one GPU.

    python bench/sft.py [--models 0.5b,1.5b] [--systems lathe,trl] [--steps 8] [--out bench/results/sft_<device>.json]
    python bench/sft.py --systems lathe --models 0.5b --ray    # one GPU through the distributed path (Ray, FSDP2)
    python bench/sft.py --device cpu --models tiny --batch 8 --micro 4 --steps 3 --warmup 1 \
        --prompt-len 8,16 --response-len 8,24 --out /tmp/sft_smoke.json                            # CPU smoke test

The workload: random-weight Qwen2.5 shapes (bench/e2e.py's), a synthetic word-level tokenizer with the model's
vocabulary, `--batch` prompt/response pairs per optimizer step with prompt and response lengths drawn uniformly from
`--prompt-len` and `--response-len` (ragged, as real SFT data is), the loss on response tokens only, AdamW, bf16
compute on fp32 master weights in both systems, no gradient checkpointing at 0.5B/1.5B.

- lathe: the `lathe sft` command in a child process, exactly as a user runs it (`data.train_batch_size=--batch`,
  micro-batches packed to `--max-tokens` real tokens: `data.use_dynamic_bsz`); per-step figures from its
  `metrics.jsonl`.
- TRL: `bench/sft_trl.py` in a child process: `SFTTrainer` on a prompt/completion data set (completion-only loss),
  `bf16=True` on fp32 weights, `per_device_train_batch_size=--micro` x `gradient_accumulation_steps=batch/micro`
  (one optimizer step per `--batch` pairs), padding to the longest in each micro-batch (TRL's default).

Reported: median seconds per optimizer step after `--warmup` steps, real tokens per second, model-FLOPs
utilisation (6 x linear params + causal attention per real token, over the datasheet bf16 peak), peak GPU memory,
and lathe/TRL speed-up. Writes JSON after every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (SHAPES, claim_workdir, datasheet_peak, default_workdir, device_name, git_sha, run_child, slug,  # noqa: E402
                    train_flops, write_model, write_tokenizer)


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def write_pairs(where: Path, *, rows: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                vocab_size: int) -> tuple[Path, list[int]]:
    """JSON lines of {prompt, completion} word strings (the same file feeds both systems) and each row's tokens."""
    g = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(2, vocab_size, (n,), generator=g))   # noqa: E731
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))   # noqa: E731
    pairs = [(draw(*prompt_len), draw(*response_len)) for _ in range(rows)]
    out = where / f"sft-{prompt_len[0]}-{prompt_len[1]}-{response_len[0]}-{response_len[1]}-{rows}.jsonl"
    # the completion opens with a space: TRL joins the two texts as they are, and the words must not merge
    out.write_text("".join(json.dumps({"prompt": words(p), "completion": " " + words(r)}) + "\n" for p, r in pairs))
    return out, [p + r + 1 for p, r in pairs]          # + eos


def lathe_command(paths: dict, args) -> list[str]:
    return [sys.executable, "-m", "lathe", "sft", f"data.train_files={paths['data']}", "data.val_files=null",
            "data.prompt_key=prompt", "data.response_key=completion", "data.response_dict_keys=null",
            f"data.train_batch_size={args.batch}", "data.shuffle=false", f"data.max_length={args.max_length}",
            "data.use_dynamic_bsz=true", f"data.max_token_len_per_gpu={args.max_tokens}",
            f"model.path={paths['model']}", f"model.tokenizer_path={paths['tokenizer']}",
            "model.enable_gradient_checkpointing=false", "optim.lr=1e-5",
            f"trainer.total_training_steps={args.steps}", "trainer.logger=[console]", "trainer.resume_mode=disable",
            f"trainer.device={args.device}", f"trainer.default_local_dir={paths['run'] / 'lathe'}"]


def bench_model(shape: str, args, peak: float | None) -> dict:
    where = claim_workdir(Path(args.workdir))
    where.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[shape]["vocab_size"]
    rows = args.batch * max(args.steps, args.trl_steps)
    data, lengths = write_pairs(where, rows=rows, prompt_len=args.prompt_len, response_len=args.response_len,
                                vocab_size=vocab)
    paths = {"model": write_model(shape, where, args.device), "tokenizer": write_tokenizer(vocab, where),
             "data": data, "run": where / f"sft-run-{shape}"}
    step_lengths = [lengths[i:i + args.batch] for i in range(0, rows, args.batch)]
    flops = statistics.median(train_flops(SHAPES[shape], ls) for ls in step_lengths)
    res = {"shape": shape, "real_tokens_per_step_median": statistics.median(sum(ls) for ls in step_lengths),
           "model_flops_per_step_median": flops}
    if "lathe" in args.systems:
        cmd = lathe_command(paths, args)
        metrics = paths["run"] / "lathe" / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        env = {"LATHE_RAY": "1"} if args.ray else {}
        rc, wall = run_child(cmd, Path(args.logs) / f"lathe-sft-{shape}.log", args.timeout, env)
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        timed = [s["timing_s/step"] for s in steps[args.warmup:]]
        res["lathe"] = {"command": " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd[1:]]), "returncode": rc,
                        "wall_s": wall, "ray_worker": args.ray,
                        "step_s_all": [s["timing_s/step"] for s in steps],
                        "loss_all": [s["train/loss"] for s in steps],
                        "max_memory_allocated_gb": max((s.get("perf/max_memory_allocated_gb", 0) for s in steps),
                                                       default=None),
                        "max_memory_reserved_gb": max((s.get("perf/max_memory_reserved_gb", 0) for s in steps),
                                                      default=None),
                        "step_s": statistics.median(timed) if timed else None}
    if "trl" in args.systems:
        out = paths["run"] / "trl.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "bench" / "sft_trl.py"), "--model", str(paths["model"]),
               "--tokenizer", str(paths["tokenizer"]), "--data", str(data), "--batch", str(args.batch),
               "--micro", str(args.micro), "--steps", str(args.trl_steps), "--max-length", str(args.max_length),
               "--out", str(out)]
        rc, wall = run_child(cmd, Path(args.logs) / f"trl-sft-{shape}.log", args.timeout)
        trl = json.loads(out.read_text()) if out.exists() else {}
        timed = trl.get("step_s_all", [])[args.warmup:]
        res["trl"] = {"command": " ".join(cmd[1:]), "returncode": rc, "wall_s": wall, **trl,
                      "step_s": statistics.median(timed) if timed else None}
    for system in ("lathe", "trl"):
        r = res.get(system, {})
        if r.get("step_s"):
            r["tokens_per_s"] = res["real_tokens_per_step_median"] / r["step_s"]
            if peak:
                r["mfu"] = flops / r["step_s"] / 1e12 / peak
    if res.get("lathe", {}).get("step_s") and res.get("trl", {}).get("step_s"):
        res["speedup_vs_trl"] = res["trl"]["step_s"] / res["lathe"]["step_s"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--systems", default="lathe,trl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ray", action="store_true", help="lathe: LATHE_RAY=1, one GPU as a Ray worker group of one FSDP2 "
                                                      "rank (the distributed path on one GPU)")
    p.add_argument("--batch", type=int, default=64, help="pairs per optimizer step")
    p.add_argument("--micro", type=int, default=8, help="TRL: pairs per forward/backward")
    p.add_argument("--max-tokens", type=int, default=16384, help="lathe: real tokens per packed micro-batch")
    p.add_argument("--prompt-len", type=span, default=(64, 512))
    p.add_argument("--response-len", type=span, default=(64, 1024))
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trl-steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median (compilation, allocator)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=default_workdir("lathe-sft"))
    p.add_argument("--logs", default=None)
    p.add_argument("--git-sha", default=None, help="the commit measured, as your checkout names it")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.systems = args.systems.split(",")
    args.logs = args.logs or str(Path(args.workdir) / "logs")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    name = device_name(torch.device(args.device))
    out = Path(args.out or ROOT / "bench" / "results" / f"sft_{slug(name)}.json")
    results = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "workload": {k: getattr(args, k) for k in ("batch", "micro", "max_tokens", "prompt_len", "response_len",
                                                          "max_length", "steps", "trl_steps", "warmup", "ray")},
               "peak_bf16_tflops_datasheet": datasheet_peak(name), "models": {}}
    for shape in args.models.split(","):
        results["models"][shape] = r = bench_model(shape, args, datasheet_peak(name))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        la, tr = r.get("lathe", {}), r.get("trl", {})
        print(f"{shape}: lathe {la.get('step_s')} s/step ({la.get('mfu')}), TRL {tr.get('step_s')} s/step "
              f"({tr.get('mfu')}), speed-up {r.get('speedup_vs_trl')}", flush=True)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
