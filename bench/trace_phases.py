"""Where a profiled `lathe train` step's wall time goes when the device is idle: a trace written by
`global_profiler.tool=torch` (`lathe.track.profile`) read phase by phase.

    python bench/trace_phases.py <save_path>/step_N/trace.json.gz [--out bench/results/trace_phases_<name>.json]

For each timed phase (`timing/<phase>` ranges): its wall time; the device's busy time (kernels and copies launched
during the phase, overlapping ones merged); the idle time before its first kernel, after its last, and between
kernels by gap size (under 5 us is the launch gap between a CUDA graph's kernels; 0.1-1 ms and more is the host
falling behind or waiting); the host's top-level operations that lasted over 1 ms (the first 40, and all of those
after the phase's last kernel). For the rollout phase (`gen`),
the decode steps as the CUDA graph replays show them: replays, the host interval between them, each replay's
device span and kernel time, and the device idle between replays; and the host time of compiled regions before
the first replay (the prefill's layers); with `global_profiler.with_stack=true`, the Python functions the host
spends more time in during the replay intervals that fall behind (over 1.5x the median) than in the others.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lathe.track.profile import DEVICE_CATEGORIES, LAUNCH_CATEGORIES, PHASE_PREFIX  # noqa: E402

BUCKETS = ((5, "under_5us"), (20, "5_20us"), (100, "20_100us"), (1000, "100us_1ms"), (float("inf"), "over_1ms"))


def load(path: Path) -> list[dict]:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)["traceEvents"]


def merged_busy(kernels: list[dict]) -> list[list[float]]:
    busy: list[list[float]] = []
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    return busy


def host_ops_over(events: list[dict], tid, start: float, end: float, threshold_us: float) -> list[dict]:
    """Top-level host operations of thread `tid` inside [start, end] lasting over `threshold_us`."""
    ops = sorted((e for e in events if e.get("tid") == tid and start <= e["ts"] <= end and e.get("cat") in
                  ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
                  and not str(e.get("name", "")).startswith(PHASE_PREFIX)), key=lambda e: (e["ts"], -e.get("dur", 0)))
    out, until = [], -1.0
    for e in ops:
        if e["ts"] < until:
            continue
        until = e["ts"] + e.get("dur", 0)
        if e.get("dur", 0) > threshold_us:
            out.append({"at_ms": round((e["ts"] - start) / 1e3, 2), "ms": round(e["dur"] / 1e3, 2),
                        "name": e["name"][:100]})
    return out


def phase_report(events: list[dict], phase: dict, launched: dict) -> dict:
    start, end = phase["ts"], phase["ts"] + phase["dur"]
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES
               and start <= launched.get(e.get("args", {}).get("correlation"), {}).get("ts", -1) <= end]
    row: dict = {"wall_ms": phase["dur"] / 1e3, "kernels": len(kernels)}
    if not kernels:
        return row
    busy = merged_busy(kernels)
    gaps = [busy[i + 1][0] - busy[i][1] for i in range(len(busy) - 1)]
    by_size = dict.fromkeys((name for _, name in BUCKETS), 0.0)
    for g in gaps:
        by_size[next(name for limit, name in BUCKETS if g < limit)] += g / 1e3
    row.update(device_busy_ms=sum(b - a for a, b in busy) / 1e3,
               idle_before_first_kernel_ms=(busy[0][0] - start) / 1e3,
               idle_after_last_kernel_ms=max(0.0, end - busy[-1][1]) / 1e3,
               idle_between_kernels_ms=by_size,
               late_launch_gaps=late_launch_gaps(events, kernels, launched),
               host_ops_over_1ms=host_ops_over(events, phase.get("tid"), start, end, 1000)[:40],
               # what the host does once the device has nothing left (the rollout's outputs, the update's end)
               host_ops_after_last_kernel_over_1ms=host_ops_over(events, phase.get("tid"), busy[-1][1], end, 1000))
    return row


def late_launch_gaps(events: list[dict], kernels: list[dict], launched: dict, min_us: float = 20,
                     top: int = 12) -> dict:
    """The device's idle gaps (over `min_us`) that end with a kernel the host launched only after the gap began: the
    host was late, not the device busy elsewhere. Each is charged to what the launching thread was doing when the
    device fell idle: its top-level operation, and (with `with_stack`) the innermost Python frame of lathe's code
    and the innermost frame of all."""
    order = sorted(kernels, key=lambda e: e["ts"])
    late, busy_end = [], None
    for e in order:
        start = e["ts"]
        if busy_end is not None and start - busy_end > min_us:
            launch = launched.get(e.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > busy_end:
                late.append((busy_end, start - busy_end, launch.get("tid")))
        end = start + e.get("dur", 0)
        busy_end = end if busy_end is None else max(busy_end, end)
    report: dict = {"min_gap_us": min_us, "count": len(late), "total_ms": sum(g for _, g, _ in late) / 1e3}
    if not late:
        return report
    for key, cats, pick in (("by_host_op", ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"), "outer"),
                            ("by_lathe_frame", ("python_function",), "lathe"),
                            ("by_python_frame", ("python_function",), "inner")):
        tids = {tid for _, _, tid in late}
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for tid in tids:
            spans = [e for e in events if e.get("tid") == tid and e.get("cat") in cats
                     and not str(e.get("name", "")).startswith(PHASE_PREFIX)]
            for (at, gap, _), chain in zip(*enclosing(spans, [(at, g, t) for at, g, t in late if t == tid])):
                name = pick_frame(chain, pick)
                if name is not None:
                    totals[name][0] += gap / 1e3
                    totals[name][1] += 1
        if totals:
            report[key] = [{"name": n[:120], "ms": round(ms, 3), "gaps": c}
                           for n, (ms, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]
    return report


def enclosing(spans: list[dict], queries: list[tuple]) -> tuple[list[tuple], list[list[str]]]:
    """For each query (its time first), the names of the spans that contain that time, outermost first: one sweep
    over the spans in start order with a stack of the open ones (a thread's spans nest)."""
    spans = sorted(spans, key=lambda e: (e["ts"], -e.get("dur", 0)))
    queries = sorted(queries)
    stack: list[tuple[float, str]] = []
    chains, i = [], 0
    for q in queries:
        t = q[0]
        while i < len(spans) and spans[i]["ts"] <= t:
            e = spans[i]
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            stack.append((e["ts"] + e.get("dur", 0), str(e.get("name", ""))))
            i += 1
        while stack and stack[-1][0] <= t:
            stack.pop()
        chains.append([name for end, name in stack if end > t])
    return queries, chains


def pick_frame(chain: list[str], pick: str) -> str | None:
    if not chain:
        return None
    if pick == "outer":
        return chain[0]
    if pick == "lathe":
        return next((n for n in reversed(chain) if "lathe/" in n and "bench/" not in n), None)
    return chain[-1]


def decode_report(events: list[dict], phase: dict, launched: dict) -> dict:
    start, end = phase["ts"], phase["ts"] + phase["dur"]
    replays = sorted((e for e in events if e.get("name") == "cudaGraphLaunch" and start <= e["ts"] <= end),
                     key=lambda e: e["ts"])
    if len(replays) < 2:
        return {"replays": len(replays)}
    ids = {e["args"]["correlation"] for e in replays if "correlation" in e.get("args", {})}
    span: dict = collections.defaultdict(lambda: [float("inf"), 0.0, 0.0])      # first start, last end, kernel sum
    for e in events:
        c = e.get("args", {}).get("correlation")
        if e.get("cat") in DEVICE_CATEGORIES and c in ids:
            s = span[c]
            s[0], s[1], s[2] = min(s[0], e["ts"]), max(s[1], e["ts"] + e.get("dur", 0)), s[2] + e.get("dur", 0)
    order = sorted(span.values(), key=lambda s: s[0])
    idle = [order[i + 1][0] - order[i][1] for i in range(len(order) - 1)]
    intervals = [replays[i + 1]["ts"] - replays[i]["ts"] for i in range(len(replays) - 1)]
    median_interval = statistics.median(intervals)
    slow = [i for i, x in enumerate(intervals) if x > 1.5 * median_interval]   # host intervals that fell behind
    first = replays[0]["ts"]
    head = [e for e in events if e.get("cat") in DEVICE_CATEGORIES
            and start <= launched.get(e.get("args", {}).get("correlation"), {}).get("ts", -1) < first]
    regions = [e for e in events if str(e.get("name", "")).startswith("Torch-Compiled Region")
               and start <= e["ts"] < first and e.get("tid") == phase.get("tid")]
    report = {"replays": len(replays), "first_replay_at_ms": (first - start) / 1e3,
            "last_replay_at_ms": (replays[-1]["ts"] - start) / 1e3,
            "host_interval_ms": {"median": median_interval / 1e3, "mean": statistics.mean(intervals) / 1e3,
                                 "over_1_5x_median": len(slow),
                                 # which replay each follows: with equal lengths, index % block_size == block_size - 1
                                 # is the step where every sequence starts a block
                                 "over_1_5x_median_after_replay": slow},
            "replay_device_span_ms_median": statistics.median(s[1] - s[0] for s in order) / 1e3,
            "replay_kernel_ms_median": statistics.median(s[2] for s in order) / 1e3,
            "device_idle_between_replays_ms": {"total": sum(max(0.0, i) for i in idle) / 1e3,
                                               "over_100us": sum(i for i in idle if i > 100) / 1e3,
                                               "count_over_100us": sum(1 for i in idle if i > 100)},
            "before_first_replay": {"device_busy_ms": sum(b - a for a, b in merged_busy(head)) / 1e3 if head else 0.0,
                                    "compiled_region_calls": len(regions),    # nested ones (after a graph break) too
                                    "compiled_region_host_ms": sum(b - a for a, b in merged_busy(regions)) / 1e3,
                                    "cudaFree_calls": sum(1 for e in events if e.get("name") == "cudaFree"
                                                          and start <= e["ts"] < first),
                                    "cudaFree_ms": sum(e.get("dur", 0) for e in events if e.get("name") == "cudaFree"
                                                       and start <= e["ts"] < first) / 1e3}}
    slow_python = python_in_slow_intervals(events, replays, set(slow), phase.get("tid"))
    if slow_python:
        report["python_in_slow_intervals"] = slow_python
    return report


def python_in_slow_intervals(events: list[dict], replays: list[dict], slow: set[int], tid, top: int = 20) -> list[dict]:
    """With `global_profiler.with_stack=true`: the Python functions (inclusive time, by name) whose mean time per
    host interval between replays is highest in the slow intervals (over 1.5x the median) compared with the others:
    what the host does more of in the steps that fall behind."""
    calls = [e for e in events if e.get("cat") == "python_function" and e.get("tid") == tid]
    if not calls:
        return []
    starts = [r["ts"] for r in replays]
    normal = len(starts) - 1 - len(slow)
    if not slow or not normal:
        return []
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in calls:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if 0 <= i < len(starts) - 1:
            sums[e["name"]][i in slow] += e.get("dur", 0)
    rows = [{"name": name[:120], "slow_interval_us": s / len(slow), "other_interval_us": o / normal}
            for name, (o, s) in sums.items()]
    rows.sort(key=lambda r: -(r["slow_interval_us"] - r["other_interval_us"]))
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--what", default="", help="a sentence saying which run the trace is of")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    events = load(args.trace)
    launched = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    phases = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    res: dict = {"bench": "trace_phases", "trace": str(args.trace), "what": args.what, "phases": {}}
    for p in sorted(phases, key=lambda e: e["ts"]):
        name = p["name"][len(PHASE_PREFIX):]
        res["phases"][name] = phase_report(events, p, launched)
        if name == "gen":
            res["phases"][name]["decode"] = decode_report(events, p, launched)
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
