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


class _Group:
    def __init__(self):
        self.calls = []

    def host_call(self, method):
        self.calls.append(method)


def test_the_first_steps_freeze_what_is_alive_and_the_end_unfreezes(monkeypatch):
    """After each of the first two steps: collected, then frozen here and in every worker group's ranks; nothing
    after them, nor where fewer than FREEZE_MIN_LEFT steps follow; unfrozen when the run ends. LATHE_GC_FREEZE=0:
    never."""
    from lathe.track.collector import FREEZE_MIN_LEFT, FREEZE_STEPS, FreezeAfterWarmup
    gc.unfreeze()
    group = _Group()
    counts, kept = [], []
    with FreezeAfterWarmup([group]) as frozen:
        for step in range(4):
            kept.append([[] for _ in range(100)])       # containers alive at the step's end
            frozen.after_step(steps_left=10)
            counts.append(gc.get_freeze_count())
        # what died of the frozen can lower the count (another thread's objects): the steps' own lists say it
        assert 0 < counts[0] and max(counts[2:]) <= counts[1]
        tracked = {id(o) for o in gc.get_objects()}     # the collector's generations, not the frozen ones
        assert [id(step) in tracked for step in kept] == [False, False, True, True]
        assert group.calls == ["freeze_collector"] * FREEZE_STEPS
    assert gc.get_freeze_count() == 0
    with FreezeAfterWarmup([group]) as frozen:       # a short run: too few steps follow to repay a collection
        frozen.after_step(steps_left=FREEZE_MIN_LEFT - 1)
        assert gc.get_freeze_count() == 0 and len(group.calls) == FREEZE_STEPS
    monkeypatch.setenv("LATHE_GC_FREEZE", "0")
    with FreezeAfterWarmup([group]) as frozen:
        frozen.after_step(steps_left=10)
        assert gc.get_freeze_count() == 0 and len(group.calls) == FREEZE_STEPS
