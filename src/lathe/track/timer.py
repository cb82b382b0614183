"""Wall-clock timing of the named phases of one RL step, under verl's metric names.

    timer = Timer()
    with timer("step"):
        with timer("gen"):
            ...
        with timer("update_actor"):
            ...
    metrics.update(timer.metrics(num_tokens={"gen": n_response_tokens, "update_actor": n_all_tokens}))
    timer.reset()

gives ``timing_s/step``, ``timing_s/gen``, ``timing_s/update_actor`` and, for names given token
counts, ``timing_per_token_ms/<name>`` (verl's ``compute_timing_metrics``: ms per token). With meters, each phase's
peak device memory (`lathe.track.memory.PeakMemory`) and the device's energy and power over it
(`lathe.track.energy.DeviceEnergy`) too.
Nesting different names is allowed (an outer phase includes its inner ones); re-entering a name
that is already open is refused because it would count the same seconds twice. While the PyTorch profiler
records (`global_profiler.tool=torch`, `lathe.track.profile`), each phase is also a profiler range
``timing/<name>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

__all__ = ["Timer"]


def _profiler_range(name: str):
    """An entered `record_function("timing/<name>")` while the PyTorch profiler records, else None (no cost)."""
    from torch.autograd import profiler
    if not profiler._is_profiler_enabled:
        return None
    label = profiler.record_function(f"timing/{name}")
    label.__enter__()
    return label


class Timer:
    """Accumulates seconds per phase name until ``reset()``; the same name used twice adds up."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, memory=None, energy=None) -> None:
        """`memory`: a `lathe.track.memory.PeakMemory` to measure each phase's peak device memory too; `energy`: a
        `lathe.track.energy.DeviceEnergy` (or None) for its energy. A new timer starts its meters afresh (a run
        keeps one energy meter and times each step with a timer of its own)."""
        self._clock = clock
        self._meters = [m for m in (memory, energy) if m is not None]
        for meter in self._meters:
            meter.reset()
        self.seconds: dict[str, float] = {}
        self._open: set[str] = set()
        self.failed_phase: str | None = None

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the ``with`` body and add its seconds to ``name`` (also when the body raises)."""
        if name in self._open:
            raise RuntimeError(
                f"Timer: phase {name!r} is already being timed; nested `with timer({name!r})` would "
                "count its seconds twice. Give the inner phase its own name."
            )
        self._open.add(name)
        for meter in self._meters:
            meter.start(name)
        start = self._clock()
        label = _profiler_range(name)
        try:
            yield
        except BaseException:
            self.failed_phase = name              # the innermost phase an exception left (see loop/oom.py)
            raise
        finally:
            if label is not None:
                label.__exit__(None, None, None)
            self.seconds[name] = self.seconds.get(name, 0.0) + (self._clock() - start)
            self._open.discard(name)
            for meter in self._meters:
                meter.stop(name)

    def metrics(self, num_tokens: Mapping[str, int] | None = None) -> dict[str, float]:
        """``{"timing_s/<name>": s}`` plus ``{"timing_per_token_ms/<name>": ms}`` for named token counts.

        Token counts of zero are skipped (no division by zero); counts for names that were never
        timed are ignored, so one shared ``num_tokens`` dict works for every step.
        """
        out = {f"timing_s/{name}": s for name, s in self.seconds.items()}
        for name, count in (num_tokens or {}).items():
            if name in self.seconds and count > 0:
                out[f"timing_per_token_ms/{name}"] = self.seconds[name] * 1000.0 / count
        for meter in self._meters:
            out.update(meter.metrics())
        return out

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` timed elsewhere (another thread's work) to phase `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def reset(self) -> None:
        """Forget the accumulated seconds (call once per step, after logging)."""
        self.seconds.clear()
        for meter in self._meters:
            meter.reset()
