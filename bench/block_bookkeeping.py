"""Host cost of the block manager's work at a decode step where every sequence crosses a block boundary.

    python bench/block_bookkeeping.py [--seqs 256] [--n 8] [--prompt-len 256] [--steps 512] [--repeats 5]
                                      [--out bench/results/block_bookkeeping_<host>.json]

With equal lengths (a GRPO rollout with `ignore_eos`, the fixed load) every sequence fills its block at the same
step and starts a new one at the next: the engine then keys `--seqs` full blocks (`BlockManager.register_full`, from
`_resolve`) and hands out as many new ones (`may_append`), on the host, while the device runs one step. A profiled
0.5B `lathe train` step on an H100 found those steps' host interval ~2x the median one and the device idle after
them (`bench/results/trace_phases_*`). This runs that bookkeeping alone, without a model: `--seqs` sequences in
groups of `--n` sharing a prompt, `--steps` tokens each, and reports the median host microseconds per sequence of
a boundary step's `register_full` and `may_append`, and of an ordinary step's `may_append`.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from lathe.engine.block_manager import BlockManager  # noqa: E402
from lathe.engine.sequence import Sequence  # noqa: E402


def run(seqs_n: int, n: int, prompt_len: int, steps: int, block_size: int = 16) -> dict[str, list[float]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(prompt_len)] for _ in range(seqs_n // n)]
    bm = BlockManager(seqs_n * ((prompt_len + steps) // block_size + 2), block_size)
    seqs = [Sequence(list(p)) for p in prompts for _ in range(n)]
    for s in seqs:
        bm.allocate(s)
    times: dict[str, list[float]] = {"register_full_us": [], "may_append_boundary_us": [], "may_append_other_us": []}
    for _ in range(steps):
        for s in seqs:                                   # the step's token arrives
            s.append_token(rng.randrange(150000), -1.0)
        boundary = len(seqs[0].token_ids) % block_size == 1     # the new token starts a block
        start = time.perf_counter()
        for s in seqs:
            if not s.tail_private or boundary:
                bm.may_append(s)
        key = "may_append_boundary_us" if boundary else "may_append_other_us"
        times[key].append((time.perf_counter() - start) / len(seqs) * 1e6)
        if len(seqs[0].token_ids) % block_size == 0:     # the token fills a block: key it
            start = time.perf_counter()
            for s in seqs:
                bm.register_full(s, len(s.token_ids) // block_size - 1)
            times["register_full_us"].append((time.perf_counter() - start) / len(seqs) * 1e6)
    return times


def main() -> None:
    from train import write_result
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [run(args.seqs, args.n, args.prompt_len, args.steps) for _ in range(args.repeats)]
    res = {"bench": "block_bookkeeping", "device": f"cpu ({platform.processor() or platform.machine()})",
           "git_sha": args.git_sha, "args": vars(args), "median_us_per_sequence": {}}
    for key in runs[0]:
        res["median_us_per_sequence"][key] = statistics.median(statistics.median(r[key]) for r in runs)
    per_step = (res["median_us_per_sequence"]["register_full_us"]
                + res["median_us_per_sequence"]["may_append_boundary_us"]) * args.seqs / 1e3
    res["boundary_step_ms"] = per_step
    print(res["median_us_per_sequence"], f"boundary step: {per_step:.2f} ms for {args.seqs} sequences", flush=True)
    if args.out:
        write_result(res, args.out)


if __name__ == "__main__":
    main()
