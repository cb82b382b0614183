"""The cyclic garbage collector's pauses: how long it held the process during a step (`timing_s/gc`, and
`perf/gc_full_passes` for generation-2 passes, which walk every tracked object and take longest).

A pause lands in whichever phase allocated last (a rollout's token lists, most often), so a step slower than its
neighbours can be told apart from one whose device work grew. lathe does not freeze its set-up objects out of the
collector's reach (`gc.freeze`, as vLLM does): measured, it did not change the step time (docs/tried_and_not_kept.md).
"""

from __future__ import annotations

import gc
import time

__all__ = ["CollectorPauses"]


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
