"""A built-in demo's reward curve and wall time: `lathe train` with no arguments, or `lathe train PRESET`.

    python bench/reward_curve.py [--out bench/results/reward_curve_cpu.json] [--plot docs/reward_curve.png]
    python bench/reward_curve.py --preset agent_demo        # the tool-calling demo: its tool-call rate too
    python bench/reward_curve.py --steps 10 --load 1 --plot '' --out /tmp/loaded.json   # a busy machine
    python bench/reward_curve.py --steps 10 --src /path/to/another/lathe --out /tmp/other.json
    python bench/reward_curve.py --set trainer.device=cuda --set actor_rollout_ref.rollout.quantization=fp8 \
        --plot '' --out bench/results/reward_curve_fp8_nvidia-h200.json     # on a GPU, FP8 rollout

Three runs share a cache directory that starts empty: a 1-step run (warm start computed), a 1-step run (warm start
read from the cache), then the measured run (`--skip-start-runs`: that one alone). `--load K` keeps K other CPU-bound
processes running for the whole run (a laptop or CI box doing something else);
`--steps` stops after that many GRPO steps; `--src` runs another checkout's lathe (its `src/`) the same way, for a
before/after comparison in one sitting; `--set KEY=VALUE` (repeatable) adds config overrides to every run (the JSON
records them, and the GPU's name when one of them is `trainer.device=cuda`).

Runs the preset (`default` unless `--preset` names another) in a fresh run directory in a subprocess (so start-up
is counted), reads its metrics.jsonl, prints a table, writes JSON (device, date, git sha, the machine's load average
at the start, per-step `critic/score/mean`, for a multi-turn run `agent/tool_calls/mean`, where reported
`training/rollout_probs_diff_mean`, wall time) and, when
matplotlib is installed, a PNG plot (by default for the `default` preset only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_sha(root: Path = ROOT) -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_preset(run_dir: Path, preset: str = "default", *, steps: int | None = None, load: int = 0,
               src: Path = ROOT, cache: Path | None = None, overrides: tuple[str, ...] = ()) -> float:
    extra = [*([f"trainer.total_training_steps={steps}"] if steps else []), *overrides]
    env = {**os.environ, "PYTHONPATH": f"{src / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    if cache is not None:
        env["LATHE_CACHE_DIR"] = str(cache)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lathe", "train", preset, f"trainer.default_local_dir={run_dir}", *extra],
                       check=True, cwd=src, env=env)
        return time.perf_counter() - start
    finally:
        for p in busy:
            p.kill()


def device(overrides: list[str]) -> str:
    if "trainer.device=cuda" in overrides:
        import torch
        return torch.cuda.get_device_name()
    return host()


def host() -> str:
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def rolling(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="default", help="the preset to run (default: `default`)")
    parser.add_argument("--out", default=None, help="default: bench/results/reward_curve[_PRESET]_cpu.json")
    parser.add_argument("--plot", default=None, help="'' for no plot (default: docs/reward_curve.png for the "
                                                     "default preset, none for others)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the preset's)")
    parser.add_argument("--load", type=int, default=0, help="other CPU-bound processes running meanwhile")
    parser.add_argument("--src", default=str(ROOT), help="the lathe checkout to run (default: this one)")
    parser.add_argument("--git-sha", default=None, help="the sha to record for --src (default: its git HEAD)")
    parser.add_argument("--skip-start-runs", action="store_true",
                        help="only the measured run (its wall time then includes the warm start)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    args = parser.parse_args()
    bad = [o for o in args.set if "=" not in o]
    if bad:
        parser.error(f"--set takes KEY=VALUE, got {bad}")
    default = args.preset == "default"
    out = args.out or str(ROOT / "bench/results" / f"reward_curve{'' if default else '_' + args.preset}_cpu.json")
    plot = args.plot if args.plot is not None else str(ROOT / "docs/reward_curve.png") if default else ""
    src = Path(args.src).resolve()
    loadavg = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"        # lathe's cache starts empty: the first run warm-starts, the next read it
        runs = dict(preset=args.preset, load=args.load, src=src, cache=cache, overrides=tuple(args.set))
        start_cold = start_cached = None
        if not args.skip_start_runs:
            start_cold = run_preset(Path(tmp) / "cold", steps=1, **runs)
            start_cached = run_preset(Path(tmp) / "cached", steps=1, **runs)
        wall = run_preset(Path(tmp) / "run", steps=args.steps, **runs)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "critic/score/mean" in r]
    step_s = [r["timing_s/step"] for r in train]
    steps = [r["step"] for r in train]
    score = [r["critic/score/mean"] for r in train]
    calls = [r["agent/tool_calls/mean"] for r in train if "agent/tool_calls/mean" in r]
    val = {r["step"]: v for r in rows for k, v in r.items() if k.startswith("val-core/")}
    smooth = rolling(score, 10)
    first_at_08 = next((s for s, v in zip(steps, smooth) if v >= 0.8), None)
    first_at_095 = next((s for s, v in zip(steps, smooth) if v >= 0.95), None)
    seconds_to_095 = round(sum(step_s[:steps.index(first_at_095) + 1]), 1) if first_at_095 else None
    result = {
        "bench": "reward_curve", "preset": args.preset, "command": "lathe train" + ("" if default else f" {args.preset}"),
        "device": device(args.set), "host": host(), "overrides": args.set,
        "date": datetime.date.today().isoformat(),
        "git_sha": args.git_sha or git_sha(src), "load": args.load, "loadavg_1_5_15_min_at_start": loadavg,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "wall_seconds": round(wall, 1), "grpo_seconds": round(sum(step_s), 2), "step_seconds": step_s,
        "one_step_run_seconds": None if start_cold is None else {"empty_cache": round(start_cold, 1),
                                                                 "warm_start_cached": round(start_cached, 1)},
        "steps": steps, "score_mean": score,
        "score_mean_rolling10": smooth, "val_greedy": val, "first_step_score": score[0],
        "final_rolling10": smooth[-1], "first_step_rolling10_ge_0.8": first_at_08,
        "first_step_rolling10_ge_0.95": first_at_095, "grpo_seconds_to_rolling10_ge_0.95": seconds_to_095,
    }
    gap = [r["training/rollout_probs_diff_mean"] for r in train if "training/rollout_probs_diff_mean" in r]
    if gap:                                     # the rollout's log-probs differ from the trainer's (e.g. FP8 rollout)
        result.update(rollout_probs_diff_mean=gap)
    if calls:                                   # a multi-turn run: tool calls per trajectory
        result.update(tool_calls_mean=calls, first_step_tool_calls=calls[0],
                      final_tool_calls_rolling10=rolling(calls, 10)[-1])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'step':>6} {'score':>8} {'rolling10':>10}" + (f" {'tool_calls':>10}" if calls else ""))
    for i in [*range(0, len(steps), 10), len(steps) - 1]:
        print(f"{steps[i]:>6} {score[i]:>8.3f} {smooth[i]:>10.3f}" + (f" {calls[i]:>10.3f}" if calls else ""))
    print(f"wall {wall:.0f} s (GRPO steps {sum(step_s):.1f} s, load {args.load}, load average {loadavg[0]}); first "
          f"step {score[0]:.3f}; rolling mean >= 0.95 from step {first_at_095} ({seconds_to_095} s of GRPO steps); "
          f"final {smooth[-1]:.3f}" + ("" if start_cold is None else f"; a 1-step run: {start_cold:.1f} s with an "
                                          f"empty cache, {start_cached:.1f} s cached") + f" -> {out}")
    plt = pyplot() if plot else None
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, score, color="#bbb", lw=1, label="critic/score/mean")
    ax.plot(steps, smooth, color="#1f77b4", lw=2, label="rolling mean (10 steps)")
    if val:
        ax.plot(list(map(int, val)), list(val.values()), "o", color="#d62728", label="validation (greedy)")
    ax.axhline(0.95, ls="--", color="k", lw=0.8)
    ax.set(xlabel="step", ylabel="reward", ylim=(0, 1.02),
           title=f"lathe train{'' if default else ' ' + args.preset} (built-in GRPO, "
                 f"{'GPU' if 'trainer.device=cuda' in args.set else 'CPU'}): {wall:.0f} s wall")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, plot)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (said once) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def save_figure(fig, where: str) -> None:
    fig.tight_layout()
    Path(where).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(where)
    print(f"plot -> {where}")


if __name__ == "__main__":
    main()
