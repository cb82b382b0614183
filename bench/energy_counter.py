"""How finely the GPU's energy counter resolves a phase: NVML's total-energy counter read in a loop of bf16 matmuls.

    python bench/energy_counter.py [--seconds 2] [--out bench/results/energy_counter_<device>.json]

`lathe.track.energy` reads that counter when each phase of a step starts and ends (`perf/energy_j/<phase>`,
`perf/power_w/<phase>`). Reported: the counter's step (the median time between two reads that see it change), the
cost of one read, the power over the loop, and the device's enforced power limit.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, device_name, git_sha, print_and_write, slug  # noqa: E402

from lathe.track.energy import DeviceEnergy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--size", type=int, default=8192, help="the matmuls' side")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device("cuda")
    meter = DeviceEnergy.open(device)
    if meter is None:
        sys.exit("energy_counter: NVML gives no energy counter for this device")
    a = torch.randn(args.size, args.size, device=device, dtype=torch.bfloat16)
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    reads, start = [], time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for _ in range(5):
            a @ a
        reads.append((time.perf_counter() - start, meter.read_mj()))
    torch.cuda.synchronize()
    changed = [t for (t, mj), (_, before) in zip(reads[1:], reads) if mj != before]
    n = 1000
    t = time.perf_counter()
    for _ in range(n):
        meter.read_mj()
    read_us = (time.perf_counter() - t) / n * 1e6
    name = device_name(device)
    doc = {"what": f"NVML's energy counter read {len(reads)} times over {args.seconds} s of {args.size}^3 bf16 "
                   "matmuls: how often it changes (the resolution of lathe.track.energy's per-phase joules)",
           "device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": git_sha(), "command": " ".join(sys.argv),
           "reads": len(reads), "changes": len(changed),
           "median_step_s": statistics.median(b - a for a, b in zip(changed, changed[1:])) if len(changed) > 2
           else None,
           "read_us": read_us, "watts": (reads[-1][1] - reads[0][1]) / 1000 / (reads[-1][0] - reads[0][0]),
           "power_limit_w": meter.limit}
    print_and_write(doc, str(args.out or ROOT / "bench" / "results" / f"energy_counter_{slug(name)}.json"))


if __name__ == "__main__":
    main()
