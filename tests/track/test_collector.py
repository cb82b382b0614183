"""The collector's pauses are counted while the block runs, and only then."""

import gc

from lathe.track.collector import CollectorPauses


def test_pauses_count_passes_in_the_block_only():
    with CollectorPauses() as pauses:
        gc.collect()                    # a full pass
        gc.collect(0)
    gc.collect()                        # after the block: not counted
    m = pauses.metrics()
    assert m["perf/gc_full_passes"] == 1.0 and pauses.passes[0] >= 1
    assert m["timing_s/gc"] > 0.0
    assert pauses._on_pass not in gc.callbacks
