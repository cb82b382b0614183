"""Reward against staleness: the built-in GRPO task in fully-async mode at several `staleness_threshold` /
`trigger_parameter_sync_step` settings, beside the synchronous loop, on the CPU (issue 47's trade-off plot).

    python bench/staleness.py [--steps 60] [--out bench/results/staleness_cpu.json] [--plot docs/staleness.png]

Each run is `lathe train fully_async` (1 trainer + 1 rollout worker on the CPU, Ray; 32 prompts x n=8 a step, two
optimizer steps of 16 prompts) with the two keys set, or `lathe train` (the synchronous loop, the same batch); all
read one warm start from a shared cache. Reported per run: `critic/score/mean` per step and its 10-step rolling mean,
`fully_async/staleness/mean` (how many syncs old a trained response's tokens were), the GRPO seconds and the wall
time. On 2 cores the two workers share the machine, so wall time says little about GPUs (`bench/fully_async.py`
measures speed there); what this shows is what staleness costs the reward per trained sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
from pathlib import Path

from reward_curve import ROOT, git_sha, pyplot, rolling, run_preset, save_figure

# (name, preset, overrides): the synchronous loop, the on-policy pipeline, then more staleness at 2 updates a sync
RUNS = [
    ("synchronous", "default", ()),
    ("on-policy (s=0, trigger 1)", "fully_async", ("async_training.staleness_threshold=0",
                                                    "async_training.trigger_parameter_sync_step=1")),
    ("s=0, trigger 2", "fully_async", ("async_training.staleness_threshold=0",
                                       "async_training.trigger_parameter_sync_step=2")),
    ("s=0.5, trigger 2 (preset)", "fully_async", ()),
    ("s=1, trigger 2", "fully_async", ("async_training.staleness_threshold=1",
                                       "async_training.trigger_parameter_sync_step=2")),
    ("s=2, trigger 4", "fully_async", ("async_training.staleness_threshold=2",
                                       "async_training.trigger_parameter_sync_step=4")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default=None, help="comma list of run indices (default: all)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/staleness_cpu.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/staleness.png"), help="'' for none")
    args = parser.parse_args()
    chosen = [RUNS[int(i)] for i in args.only.split(",")] if args.only else RUNS
    result = {"bench": "staleness", "device": f"cpu ({os.cpu_count()} cores)",
              "date": datetime.date.today().isoformat(), "git_sha": git_sha(), "steps": args.steps,
              "loadavg_1_5_15_min_at_start": [round(x, 2) for x in os.getloadavg()], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for i, (name, preset, overrides) in enumerate(chosen):
            run_dir = Path(tmp) / f"run{i}"
            wall = run_preset(run_dir, preset, steps=args.steps, cache=cache,
                              overrides=("trainer.test_freq=-1", "trainer.val_before_train=false",
                                         "trainer.save_freq=-1", "trainer.logger=[console]", *overrides))
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if "critic/score/mean" in r]
            score = [r["critic/score/mean"] for r in train]
            stale = [r["fully_async/staleness/mean"] for r in train if "fully_async/staleness/mean" in r]
            result["runs"][name] = {
                "command": f"lathe train {preset} " + " ".join(overrides), "wall_seconds": round(wall, 1),
                "grpo_seconds": round(sum(r.get("perf/time_per_step", r.get("timing_s/step", 0)) for r in train), 1),
                "score_mean": score, "score_mean_rolling10": rolling(score, 10),
                "final_rolling10": rolling(score, 10)[-1], "staleness_mean": stale,
                "staleness_mean_median": statistics.median(stale) if stale else 0.0}
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(f"{name:>28}: final rolling-10 score {result['runs'][name]['final_rolling10']:.3f}, staleness "
                  f"{result['runs'][name]['staleness_mean_median']:.2f}, wall {wall:.0f} s", flush=True)
    print(f"-> {args.out}")
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, where: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    for name, run in result["runs"].items():
        smooth = run["score_mean_rolling10"]
        ax.plot(range(1, len(smooth) + 1), smooth, lw=1.6,
                label=f"{name}: staleness {run['staleness_mean_median']:.2f}")
    ax.set(xlabel="step (32 prompts x 8 samples)", ylabel="reward (10-step rolling mean)",
           title="Built-in GRPO task on the CPU: reward against staleness")
    ax.legend(loc="lower right", fontsize=7)
    save_figure(fig, where)

if __name__ == "__main__":
    main()
