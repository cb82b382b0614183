"""The bf16 matmul rate a GPU sustains at its power cap (issue 48: the speed-of-light bound assumes 790 TFLOP/s).

An 8192^3 torch.matmul of randn data for 1 s and for 8 s (each after 3 s idle), its TFLOP/s, with nvidia-smi sampled
every 50 ms beside it: mean SM clock, mean power, the power limit and the share of samples with the software
power-cap throttle reason. Writes JSON (device, date, git sha).

    python bench/matmul_sustained.py --out bench/results/matmul_sustained_<device>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_sha, slug  # noqa: E402

SMI = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,"
       "clocks_throttle_reasons.active", "--format=csv,noheader,nounits", "-lms", "50"]
SW_POWER_CAP = 0x4


def window(rows: list[list[str]], start: float, end: float) -> dict:
    """nvidia-smi's samples between `start` and `end` (epoch seconds), summarised."""
    def stamp(row):
        return datetime.datetime.strptime(row[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()

    inside = [r for r in rows if start <= stamp(r) <= end]

    def column(i):
        return [float(r[i]) for r in inside if r[i].replace(".", "", 1).isdigit()]

    def mean(xs):
        return sum(xs) / max(1, len(xs))

    return {"samples": len(inside), "sm_clock_mhz_mean": mean(column(1)), "sm_clock_max_mhz": max(column(2) or [0]),
            "power_w_mean": mean(column(3)), "power_limit_w": max(column(4) or [0]),
            "power_cap_fraction": sum(1 for r in inside if int(r[6], 16) & SW_POWER_CAP) / max(1, len(inside))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=8192)
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"matmul_sustained_{slug(name)}.json")
    samples = out.with_suffix(".smi.csv")
    with open(samples, "w") as f:
        smi = subprocess.Popen(SMI, stdout=f)
        n = args.n
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        res = {}
        for secs in (1, 8):
            time.sleep(3)                   # idle clocks before each window
            start, t0, k = time.time(), time.perf_counter(), 0
            while time.perf_counter() - t0 < secs:
                for _ in range(20):
                    a @ b
                torch.cuda.synchronize()
                k += 20
            dt = time.perf_counter() - t0
            res[f"{secs}s"] = {"tflops": 2 * n ** 3 * k / dt / 1e12, "matmuls": k, "s": dt, "t_start": start,
                               "t_end": time.time()}
        smi.terminate()
        smi.wait()
    rows = [line.split(", ") for line in samples.read_text().splitlines() if line.count(",") >= 6]
    for r in res.values():
        r.update(window(rows, r["t_start"], r["t_end"]))
    samples.unlink()
    doc = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": git_sha(), "matmul_n": n, **res}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
