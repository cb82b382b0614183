"""What keeps PyTorch's cached memory from the driver: the segments of a CUDA memory snapshot that hold much free
memory around few live blocks, and those blocks with their allocation stacks.

    python bench/alloc_snapshot.py SNAPSHOT.pickle[.gz] OUT.json [--note TEXT] [--git-sha SHA] [--device NAME]

SNAPSHOT is what `global_profiler.tool=torch_memory` wrote (`<save_path>/step_N/torch_memory_rank0.pickle`, history
recorded from the step's start, so the blocks made in it carry their frames). A segment is listed when at least
`--free-mib` of it is free while some of it is allocated: `empty_cache` cannot give such a segment back, however
little of it is in use.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import pickle
import sys
from pathlib import Path

GIB, MIB = 2**30, 2**20


def held_segments(snapshot: dict, free_mib: float = 64.0) -> dict:
    """The snapshot's totals and its segments with at least `free_mib` free and something allocated, each with its
    live blocks (size, the first frames of their allocation stacks)."""
    segments = snapshot["segments"]
    held = []
    for s in segments:
        free = s["total_size"] - s["allocated_size"]
        if s["allocated_size"] > 0 and free >= free_mib * MIB:
            live = [{"size_mib": b["size"] / MIB, "frames": [f"{_short(f['filename'])}:{f['line']}:{f['name']}"
                                                               for f in (b.get("frames") or [])[:8]]}
                    for b in s["blocks"] if b["state"] == "active_allocated"]
            held.append({"total_gib": s["total_size"] / GIB, "free_gib": free / GIB,
                         "allocated_mib": s["allocated_size"] / MIB, "live_blocks": live})
    held.sort(key=lambda h: -h["free_gib"])
    return {"segments": len(segments), "reserved_gib": sum(s["total_size"] for s in segments) / GIB,
            "allocated_gib": sum(s["allocated_size"] for s in segments) / GIB,
            "held_free_gib": sum(h["free_gib"] for h in held), "held_segments": held}


def _short(filename: str) -> str:
    """A frame's file from its package on (site-packages' or a checkout's src/)."""
    return filename.split("site-packages/")[-1].split("/src/")[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--note", default="", help="stored as the result's `what`")
    p.add_argument("--git-sha", default=None, help="the commit the snapshot's run ran (default: this tree's)")
    p.add_argument("--device", default=None, help="the device the run used (the snapshot does not name it)")
    p.add_argument("--free-mib", type=float, default=64.0)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_sha
    opener = gzip.open if args.snapshot.suffix == ".gz" else open
    with opener(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    doc = {"what": args.note, "device": args.device,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": args.git_sha or git_sha(), "snapshot": str(args.snapshot), **held_segments(snapshot,
                                                                                               args.free_mib)}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"{doc['segments']} segments, {doc['reserved_gib']:.2f} GiB reserved, {doc['allocated_gib']:.2f} allocated; "
          f"{len(doc['held_segments'])} held with {doc['held_free_gib']:.2f} GiB free")


if __name__ == "__main__":
    main()
