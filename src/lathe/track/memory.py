"""Peak device memory per phase of a step, under verl's metric names.

`PeakMemory` hooks into `Timer` (`Timer(memory=PeakMemory(device))`): each timed phase starts with the
device's peak counters reset and ends by reading them, giving

- `perf/max_memory_allocated_gb/<phase>` and `perf/max_memory_reserved_gb/<phase>` for every phase, and
- `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb` (verl's names): the largest over the step.

Nested phases (an outer phase around inner ones) report the peak since their inner phases last reset the
counters, so the step-wide figures are the ones to read for nesting code. On a CPU it reports nothing.
"""

from __future__ import annotations


def _accel():
    """`lathe.device`, imported on first use: it imports torch, which the CLI's start (`lathe.track`) must not."""
    from lathe import device
    return device


class PeakMemory:
    def __init__(self, device):
        self.device = device
        self.gb: dict[str, tuple[float, float]] = {}

    def start(self, name: str) -> None:
        _accel().reset_peak_memory(self.device)

    def stop(self, name: str) -> None:
        peak = _accel().peak_memory(self.device)
        if peak is not None:
            old = self.gb.get(name, (0.0, 0.0))
            self.gb[name] = (max(old[0], peak[0] / 2**30), max(old[1], peak[1] / 2**30))

    def metrics(self) -> dict[str, float]:
        if not self.gb:
            return {}
        out = {}
        for name, (alloc, reserved) in self.gb.items():
            out[f"perf/max_memory_allocated_gb/{name}"] = alloc
            out[f"perf/max_memory_reserved_gb/{name}"] = reserved
        out["perf/max_memory_allocated_gb"] = max(a for a, _ in self.gb.values())
        out["perf/max_memory_reserved_gb"] = max(r for _, r in self.gb.values())
        return out

    def reset(self) -> None:
        self.gb.clear()
