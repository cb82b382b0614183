"""bench/alloc_snapshot.py on a hand-made snapshot: a segment mostly free around one live block is listed with the
block's frames; a wholly free one, a full one and one with little free are not."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_alloc_snapshot", ROOT / "bench" / "alloc_snapshot.py")
alloc_snapshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(alloc_snapshot)

MIB, GIB = 2**20, 2**30


def _segment(total, blocks):
    return {"total_size": total, "allocated_size": sum(s for s, state, _ in blocks if state == "active_allocated"),
            "blocks": [{"size": s, "state": state, "frames": frames} for s, state, frames in blocks]}


def test_a_segment_held_by_one_small_block_is_listed_with_its_frames():
    frame = {"filename": "/x/site-packages/torch/_ops.py", "line": 865, "name": "__call__"}
    own = {"filename": "/w/main/src/lathe/models/logprob.py", "line": 34, "name": "_chunk_logits"}
    snapshot = {"segments": [
        _segment(62 * GIB, [(30 * GIB, "inactive", []), (32 * MIB, "active_allocated", [frame, own]),
                            (32 * GIB - 32 * MIB, "inactive", [])]),
        _segment(4 * GIB, [(4 * GIB, "inactive", [])]),                               # wholly free: empty_cache's
        _segment(2 * GIB, [(2 * GIB, "active_allocated", [])]),                       # full
        _segment(100 * MIB, [(90 * MIB, "active_allocated", []), (10 * MIB, "inactive", [])])]}   # little free
    out = alloc_snapshot.held_segments(snapshot)
    assert out["segments"] == 4 and abs(out["reserved_gib"] - (68 * GIB + 100 * MIB) / GIB) < 1e-9
    assert len(out["held_segments"]) == 1
    held = out["held_segments"][0]
    assert held["total_gib"] == 62 and abs(held["free_gib"] - (62 * GIB - 32 * MIB) / GIB) < 1e-9
    assert held["live_blocks"] == [{"size_mib": 32.0, "frames": ["torch/_ops.py:865:__call__",
                                                                 "lathe/models/logprob.py:34:_chunk_logits"]}]
    assert out["held_free_gib"] == held["free_gib"]
