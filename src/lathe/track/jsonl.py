"""``metrics.jsonl``: the run's always-on, append-only record, one JSON object per step.

Each line is ``{"step": s, **metrics}``, flushed as soon as it is written so a crash loses at
most the step in flight. Two rules keep exactly one line per step:

* resume: ``truncate_after(step)`` drops the lines of steps later than the checkpoint (they
  belong to the abandoned future) and any torn last line a crash left behind;
* a second ``append`` for the step just written (e.g. validation logged apart from training
  metrics) merges into that line instead of adding another.

Values are written with Python's ``json``; NaN and infinities appear as ``NaN``/``Infinity``,
which Python's ``json`` and pandas read back.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["MetricsFile", "read_metrics"]


def _parse(line: str) -> dict[str, Any] | None:
    """The record on ``line``, or None when it is torn/garbled or lacks an integer ``step``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All well-formed records of a ``metrics.jsonl`` file, in file order (missing file: empty)."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [r for r in (_parse(line) for line in f if line.strip()) if r is not None]


class MetricsFile:
    """Appends step records to ``path`` and keeps one line per step (see module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last: dict[str, Any] | None = None  # record on the last line
        self._last_offset = 0  # byte offset where the last line starts
        self._warned_order = False
        self._scan_tail()
        self._file = self.path.open("ab")
        self._end_line()

    def _end_line(self) -> None:
        """Terminate a torn last line (crash mid-write) so the next record starts on its own line."""
        end = self._file.seek(0, os.SEEK_END)
        if end > 0:
            with self.path.open("rb") as f:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    self._file.write(b"\n")
                    self._file.flush()

    def _scan_tail(self) -> None:
        """Find the last well-formed line so a repeat of its step can be merged into it."""
        self._last, offset = None, 0
        if self.path.exists():
            with self.path.open("rb") as f:
                for raw in f:
                    record = _parse(raw.decode("utf-8", errors="replace"))
                    if record is not None:
                        self._last, self._last_offset = record, offset
                    offset += len(raw)

    def append(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``{"step": step, **metrics}``; merge into the last line if it holds the same step."""
        if self._last is not None and self._last["step"] == step:
            merged = {**self._last, **metrics, "step": step}
            self._file.flush()
            self._file.truncate(self._last_offset)
            self._file.seek(self._last_offset)
            self._write(merged, self._last_offset)
            return
        if self._last is not None and step < self._last["step"] and not self._warned_order:
            self._warned_order = True
            warnings.warn(
                f"{self.path}: step {step} logged after step {self._last['step']}; on resume call "
                f"Tracker.truncate_after(<resumed step>) first so each step has one line",
                stacklevel=3,
            )
        self._write({"step": step, **metrics}, self._file.seek(0, os.SEEK_END))

    def _write(self, record: dict[str, Any], offset: int) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._file.write(line.encode("utf-8"))
        self._file.flush()
        self._last, self._last_offset = record, offset

    def truncate_after(self, step: int) -> int:
        """Drop the lines of steps ``> step`` and unreadable lines; returns how many were dropped.

        The kept lines are written to a temporary file that then replaces the original, so an
        interruption leaves either the old file or the new one, never half of each.
        """
        self._file.close()
        kept, dropped = [], 0
        if self.path.exists():
            with self.path.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    record = _parse(line) if line.strip() else None
                    if record is not None and record["step"] <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                    elif line.strip():
                        dropped += 1
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self._scan_tail()
        self._file = self.path.open("ab")
        return dropped

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
