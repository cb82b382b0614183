"""Run one-GPU bench commands side by side, one GPU each, in one device call (an A/B "from one call" on the x2 kind).

    python bench/parallel.py --logs $OUT/logs -- \
        "python bench/e2e.py --systems lathe --models 7b --out $OUT/a.json" \
        "python bench/e2e.py --systems lathe --models 7b --extra k=v --out $OUT/b.json"

Command i runs with CUDA_VISIBLE_DEVICES=i (or the i-th of `--gpus`) and a temp dir of its own (`TMPDIR`, under which
the benches put their default `--workdir`: arms that shared /tmp/lathe-e2e read one run's metrics twice and lost a 7B
A/B; a bench also refuses a workdir another one holds), its output in `--logs`/arm<i>.log; this waits
for all of them (no `pgrep` loop, no outer `timeout` cut shorter than a bench's own: both lost a 7B A/B once) and
returns the worst return code. A SIGTERM to it (the call's own limit) is passed on to every arm, whose benches
(`bench/common.run_child`) stop their children and still write their JSON; it then waits up to `--grace` seconds.
Arms share the host's CPU cores: time what runs on the GPUs, not host-bound work.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", default=None, help="comma list of GPU ids, one per command (default 0,1,...)")
    p.add_argument("--logs", default="bench_parallel_logs")
    p.add_argument("--grace", type=float, default=60.0, help="seconds the arms get to write after a SIGTERM")
    p.add_argument("commands", nargs="+", help="shell command lines, one per arm")
    args = p.parse_args(argv)
    gpus = args.gpus.split(",") if args.gpus else [str(i) for i in range(len(args.commands))]
    if len(gpus) < len(args.commands):
        p.error(f"{len(args.commands)} commands but --gpus names {len(gpus)} GPUs")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    arms = []
    for i, (cmd, gpu) in enumerate(zip(args.commands, gpus)):
        log = open(logs / f"arm{i}.log", "w")
        tmp = tempfile.mkdtemp(prefix=f"bench-arm{i}-")     # a new one each call: two calls at once stay apart
        arms.append(subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "TMPDIR": tmp}))
        print(f"arm{i} on GPU {gpu}: {cmd}", flush=True)

    stopped: list[float] = []                       # when a SIGTERM came (the handler only forwards it)

    def signal_arms(sig: int) -> None:
        for arm in arms:
            if arm.poll() is None:
                try:
                    os.killpg(arm.pid, sig)
                except ProcessLookupError:                # it ended meanwhile
                    pass

    def forward(signum, frame):
        stopped.append(time.monotonic())
        signal_arms(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    start = time.perf_counter()
    while any(arm.poll() is None for arm in arms):   # polled: a blocking wait would hold Popen's lock in the handler
        if stopped and time.monotonic() - stopped[0] > args.grace:
            signal_arms(signal.SIGKILL)
        time.sleep(0.2)
    codes = [arm.returncode for arm in arms]
    for i, rc in enumerate(codes):
        print(f"arm{i}: rc {rc} ({logs / f'arm{i}.log'})", flush=True)
    print(f"all arms done in {time.perf_counter() - start:.0f} s", flush=True)
    return 143 if stopped else max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
