"""The same rollout, repeated in one process: how much it varies, and whether the GPU's clocks explain it.

    python bench/rollout_variance.py [--models 0.5b] [--repeats 8] [--out bench/results/rollout_variance_<device>.json]

`bench/rollout.py`'s fixed load (256 prompts x 256 tokens, 512 forced new tokens, cold prefix cache each call) run
`--repeats` times on one engine. For each call: tokens per second, prefill and decode wall time, and what
`nvidia-smi` reported every `--sample-ms` while it ran (SM and memory clocks, power draw, temperature, active
clock-throttle reasons), and the Python garbage collector's passes during the call (count and seconds per
generation). The spread of the calls' rates, and their correlation with the mean SM clock, say whether a
difference between two measurements is the engine's or the GPU's. `--gc-modes on,off` runs the calls once with the
collector as it is and once disabled during each call (an A/B of host pauses), in the order given.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from rollout import StepStats, fixed_load_engine  # noqa: E402
from train import result_header, sync, write_result  # noqa: E402


FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")


class Sampler:
    """nvidia-smi polled in a thread while `on`; one row of FIELDS per poll."""

    def __init__(self, index: int, period_ms: int):
        self.cmd = ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
        self.period, self.rows, self.on, self.stop = period_ms / 1e3, [], False, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if self.on:
                try:
                    out = subprocess.run(self.cmd, capture_output=True, text=True, timeout=5).stdout.strip()
                    self.rows.append([x.strip() for x in out.split(",")])
                except (OSError, subprocess.SubprocessError):
                    pass
            time.sleep(self.period)

    def take(self) -> dict:
        rows, self.rows = self.rows, []

        def num(i):
            vals = []
            for r in rows:
                try:
                    vals.append(float(r[i]))
                except (ValueError, IndexError):
                    pass
            return vals
        summary = {}
        for i, name in enumerate(FIELDS[:4]):
            vals = num(i)
            if vals:
                summary[name] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
        summary["throttle_reasons_seen"] = sorted({r[4] for r in rows if len(r) > 4})
        summary["samples"] = len(rows)
        return summary


class GcTimer:
    """Seconds and count of the cyclic garbage collector's passes, per generation, since the last `take`."""

    def __init__(self):
        self.start, self.stats = None, {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self.start = time.perf_counter()
        elif self.start is not None:
            n, s = self.stats.get(info["generation"], (0, 0.0))
            self.stats[info["generation"]] = (n + 1, s + time.perf_counter() - self.start)
            self.start = None

    def take(self) -> dict:
        stats, self.stats = self.stats, {}
        return {f"gen{g}": {"passes": n, "seconds": s} for g, (n, s) in sorted(stats.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--sample-ms", type=int, default=50)
    ap.add_argument("--gc-modes", default="on", help="on, off or both in order (off: collector disabled in each call)")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {**result_header("rollout_variance", device, args), "models": {}}
    sampler = Sampler(torch.cuda.current_device(), args.sample_ms)
    gc_timer = GcTimer()
    for model_name in args.models.split(","):
        engine, prompts, params = fixed_load_engine(model_name, device, args)
        engine.generate(prompts, params)         # compiles and graph captures
        sync(device)
        stats = StepStats(engine)
        row = {}
        for mode in [f"gc_{m}" for m in args.gc_modes.split(",")]:
            calls = []
            for _ in range(args.repeats):
                engine.update_weights([])            # a cold prefix cache, as after a training step's weight sync
                stats.reset()
                gc_timer.take()
                if mode == "gc_off":
                    gc.disable()
                sampler.on = True
                start = time.perf_counter()
                out = engine.generate(prompts, params)
                sync(device)
                seconds = time.perf_counter() - start
                sampler.on = False
                gc.enable()
                tokens = sum(len(t) for t in out.token_ids)
                calls.append({"seconds": seconds, "tok_s": tokens / seconds, "steps": stats.reset(),
                              "gc": gc_timer.take(), "gpu": sampler.take()})
                print(model_name, mode, f"{tokens / seconds:,.0f} tok/s", calls[-1]["gc"],
                      calls[-1]["gpu"].get("clocks.sm"), flush=True)
            gc.collect()
            rates = [c["tok_s"] for c in calls]
            clocks = [c["gpu"].get("clocks.sm", {}).get("mean") for c in calls]
            part = {"calls": calls, "tok_s_min": min(rates), "tok_s_max": max(rates),
                    "tok_s_median": statistics.median(rates), "spread_max_over_min": max(rates) / min(rates)}
            if all(c is not None for c in clocks) and len(set(clocks)) > 1 and len(set(rates)) > 1:
                part["corr_tok_s_sm_clock"] = statistics.correlation(rates, clocks)
            row[mode] = part
        res["models"][model_name] = row
        engine.sleep()
        del engine
        torch.cuda.empty_cache()
    sampler.stop = True
    write_result(res, args.out)


if __name__ == "__main__":
    main()
