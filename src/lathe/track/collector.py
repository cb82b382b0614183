"""The cyclic garbage collector's pauses: how long it held the process during a step (`timing_s/gc`, and
`perf/gc_full_passes` for generation-2 passes, which walk every tracked object and take longest).

A pause lands in whichever phase allocated last (a rollout's token lists, most often), so a step slower than its
neighbours can be told apart from one whose device work grew.

After its first steps a run freezes what is alive (`FreezeAfterWarmup`, `gc.freeze` as vLLM does after start-up): the
compiled graphs, their guards and the engines' caches are then no longer walked by a full pass. GPT-OSS-20B-8l runs on
an H200 spent 1.1-1.9 s in the collector in their first step (2-3 full passes), and unfrozen 0.41-0.48 s a step
after it (`e2e_ab_sinks_flash_gpt-oss-20b-8l_*`, `e2e_prefix_grouper_on_1024_gpt-oss-20b-8l_*`); frozen, 0.045 s a
step, a step with a full pass included (`e2e_gc_freeze_on_grouped_1024_gpt-oss-20b-8l_*`; not an A/B in one call:
an unfrozen per-row run of the same call had no full pass after its first step and 0.04 s). At 0.5B on an H100 the
pauses were 5-12 ms a step either way (docs/tried_and_not_kept.md).
"""

from __future__ import annotations

import gc
import os
import time

__all__ = ["CollectorPauses", "FreezeAfterWarmup"]

FREEZE_STEPS = 2
# the fewest steps that must follow a freeze for it to be taken: its full collection costs about one full pass (~0.25 s
# in the test suite's processes), a later step that would have walked the frozen objects gains up to 0.4 s
# (GPT-OSS-20B-8l). A run of one or two steps (most test runs, a smoke run) only paid; `bench/e2e.py`'s four steps
# (two timed) still freeze after the first two, as a long run does
FREEZE_MIN_LEFT = 2


class FreezeAfterWarmup:
    """After each of the first `FREEZE_STEPS` steps this run takes (`after_step`; a resumed run's too), collect
    once and move every object alive then (the model, the compiled graphs and their guards, the engine's caches) to
    the collector's permanent generation, so that later passes do not walk them: in this process and in the ranks of
    the Ray worker `groups` (`RankHost.freeze_collector`), where the models live in a distributed run. Leaving the
    `with` block unfreezes this process's objects, so that a process that trains again (a test, a notebook) reclaims
    them as before (a rank's process ends with its run). A step with fewer than `FREEZE_MIN_LEFT` steps after it
    freezes nothing (too few steps follow to repay the collection: the test suite's two-step runs spent 15% of their
    time in it). `LATHE_GC_FREEZE=0` turns it off (an A/B)."""

    def __init__(self, groups=()) -> None:
        self.groups = list(groups)
        self.frozen = False
        self.steps = 0
        self.enabled = os.environ.get("LATHE_GC_FREEZE", "1") != "0"

    def __enter__(self) -> "FreezeAfterWarmup":
        return self

    def after_step(self, steps_left: int) -> None:
        """`steps_left`: the steps this run takes after this one."""
        self.steps += 1
        if self.enabled and self.steps <= FREEZE_STEPS and steps_left >= FREEZE_MIN_LEFT:
            for group in self.groups:
                group.host_call("freeze_collector")
            gc.collect()
            gc.freeze()
            self.frozen = True

    def __exit__(self, *exc) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


class CollectorPauses:
    """Seconds and passes of the collector while the `with` block runs (also passes started by `gc.collect()`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.passes = [0, 0, 0]
        self._start: float | None = None

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.passes[info["generation"]] += 1
            self._start = None

    def __enter__(self) -> "CollectorPauses":
        gc.callbacks.append(self._on_pass)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_pass)

    def metrics(self) -> dict[str, float]:
        """`timing_s/gc` (seconds in the collector) and `perf/gc_full_passes` (generation-2 passes)."""
        return {"timing_s/gc": self.seconds, "perf/gc_full_passes": float(self.passes[2])}
