"""verl's `global_profiler` with `tool=torch_memory`: a CUDA memory snapshot of each listed training step, per rank.

    global_profiler.tool=torch_memory global_profiler.steps=[1,5] global_profiler.save_path=outputs/profile
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000   # events kept (torch's max_entries)
    global_profiler.global_tool_config.torch_memory.context=all   stacks=all   kw_args={...}

For each listed step N, each trainer rank records its allocator's history (every allocation and free, with its
Python and C++ stack) from the step's start and, at its end, writes `<save_path>/step_N/torch_memory_rank0.pickle`
(one device: the trainer process) or `<save_path>/step_N/torch_memory_<group>_rank<R>.pickle` (each rank of each
Ray worker group), then stops recording: the steps between pay nothing. The snapshot holds the allocator's segments
and blocks at the step's end (the live tensors, those allocated before the step too, without their stacks) and the
step's events; drag it into https://pytorch.org/memory_viz, or read it with `pickle.load`.
With `global_profiler.steps` unset (verl's profile script sets none, and verl then writes nothing) step 1 is recorded.
CUDA only: `config.rules` refuses trainer.device=cpu; a run that lands on the CPU (trainer.device=auto without a GPU)
says so once and records nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from lathe import device as accel
from lathe.config.profiler import MemoryHistorySettings

log = logging.getLogger(__name__)

__all__ = ["MemoryHistory", "snapshot_name"]


def snapshot_name(rank: int, group: str | None = None) -> str:
    """The snapshot file of one rank in a step's directory."""
    return f"torch_memory_{group}_rank{rank}.pickle" if group else f"torch_memory_rank{rank}.pickle"


class MemoryHistory:
    """One process's allocator history on `device`, from `start` to `dump` (`settings`: how much and which stacks)."""

    def __init__(self, device: torch.device, settings: MemoryHistorySettings | dict):
        self.device = torch.device(device)
        self.settings = settings if isinstance(settings, MemoryHistorySettings) else MemoryHistorySettings(**settings)
        self.recording = False

    def start(self) -> None:
        s = self.settings
        accel.record_memory_history(self.device, max_entries=s.max_entries, context=s.context, stacks=s.stacks,
                                    **s.kw_args)
        self.recording = True

    def dump(self, path: Path) -> Path:
        """Write the snapshot to `path` (its directory made) and stop recording."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            accel.dump_memory_snapshot(self.device, str(path))
        finally:
            self.stop()
        return path

    def stop(self) -> None:
        if self.recording:
            accel.stop_memory_history(self.device)
            self.recording = False

    def as_dict(self) -> dict:
        """The settings as plain values (what the driver sends each Ray rank)."""
        return dataclasses.asdict(self.settings)
