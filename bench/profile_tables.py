"""Every kernel of each phase of a profiled `lathe train` step, and where the device waited between them.

    python bench/profile_tables.py RUN_DIR/profile OUT.json [--note TEXT]

RUN_DIR/profile is what `global_profiler.tool=torch` wrote (bench/e2e.py --profile-step N: under its workdir's
`run-<shape>/lathe/profile`); the first `trace.json.gz` under it is read. The run's own `summary.json` lists the 15
longest kernels a phase (`lathe.track.profile.TOP`); this lists all of them, each phase's device time by kernel class
(`lathe.track.profile.kernel_class`), and the device's idle time inside the phase's span: gaps between the end of one
kernel or copy and the start of the next among those the phase launched, by size, the largest with the kernels on
either side, and summed by that pair. A phase whose device time is near its span and whose gaps are small is bound by
its kernels, not by the host.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lathe.track import profile  # noqa: E402

BUCKETS = ((2, "<2us"), (5, "<5us"), (20, "<20us"), (100, "<100us"), (1000, "<1ms"), (float("inf"), ">=1ms"))


def launched_by_phase(trace: dict) -> dict[str, list[tuple[float, float, str]]]:
    """{phase: [(start us, end us, name)]} of the device's kernels and copies, each in the phase whose range held its
    launch (the innermost, as `profile.device_phases` attributes them)."""
    events = trace.get("traceEvents", [])
    prefix = profile.PHASE_PREFIX
    windows = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(prefix):]) for e in events
                      if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)),
                     key=lambda w: w[1] - w[0])
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in profile.LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    out: dict[str, list] = {}
    for e in events:
        if e.get("cat") not in profile.DEVICE_CATEGORIES:
            continue
        t = launched.get(e.get("args", {}).get("correlation"))
        phase = next((n for s, end, n in windows if t is not None and s <= t <= end), profile.NO_PHASE)
        out.setdefault(phase, []).append((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?")))
    return out


def gaps(spans: list[tuple[float, float, str]], largest: int = 25) -> dict:
    """The device's idle time between `spans` (overlapping ones merged): total, by size, the largest, by pair."""
    spans = sorted(spans)
    end, before, found = spans[0][1], spans[0][2], []
    for start, stop, name in spans[1:]:
        if start > end:
            found.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    by_size = {label: {"count": 0, "s": 0.0} for _, label in BUCKETS}
    pairs: dict[str, list] = {}
    for us, a, b in found:
        row = by_size[next(label for bound, label in BUCKETS if us < bound)]
        row["count"] += 1
        row["s"] += us / 1e6
        pair = pairs.setdefault(f"{a[:70]} -> {b[:70]}", [0, 0.0])
        pair[0] += 1
        pair[1] += us / 1e6
    return {"span_s": (max(s[1] for s in spans) - spans[0][0]) / 1e6, "idle_s": sum(g[0] for g in found) / 1e6,
            "by_size": by_size,
            "largest_us": [[round(us, 3), a[:100], b[:100]] for us, a, b in sorted(found, reverse=True)[:largest]],
            "by_pair": sorted(([k, n, s] for k, (n, s) in pairs.items()), key=lambda r: -r[2])[:largest]}


def tables(trace: dict) -> dict:
    """{phase: {wall_s, device_s, idle_s, span_s, classes, kernels, gaps, host_top}}."""
    phases = profile.device_phases(trace, top=1 << 20)      # every kernel, not the summary's few
    spans = launched_by_phase(trace)
    out = {}
    for name, phase in phases.items():
        classes = dict.fromkeys(profile.CLASSES, 0.0)
        for row in phase["top"]:
            classes[profile.kernel_class(row["name"])] += row["s"]
        g = gaps(spans[name]) if spans.get(name) else None
        out[name] = {"wall_s": phase["wall_s"], "device_s": phase["device_s"],
                     "span_s": g and g["span_s"], "idle_s": g and g["idle_s"],
                     "classes": {k: v for k, v in classes.items() if v},
                     "kernels": [dict(row, **{"class": profile.kernel_class(row["name"])}) for row in phase["top"]],
                     "gaps": g, "host_top": phase["host_top"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--note", default="", help="stored as the result's `what`")
    p.add_argument("--git-sha", default=None, help="the commit the profiled run ran (default: this tree's)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_sha          # (here: importing this module for its functions leaves the path alone)
    found = sorted(args.profile_dir.rglob("trace.json.gz"))
    if not found:
        sys.exit(f"profile_tables: no trace.json.gz under {args.profile_dir} (run with global_profiler.tool=torch)")
    with gzip.open(found[0]) as f:
        trace = json.load(f)
    phases = tables(trace)
    devices = trace.get("deviceProperties") or [{}]
    doc = {"what": args.note, "device": devices[0].get("name"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": args.git_sha or git_sha(), "trace": str(found[0]), "phases": phases}
    args.out.write_text(json.dumps(doc, indent=1))
    for name, ph in phases.items():
        if ph["device_s"]:
            print(f"{name}: wall {ph['wall_s'] or 0:.3f} s, device {ph['device_s']:.3f}, idle in its span "
                  f"{ph['idle_s'] or 0:.3f}; " + ", ".join(f"{k} {v:.3f}" for k, v in ph["classes"].items()))


if __name__ == "__main__":
    main()
