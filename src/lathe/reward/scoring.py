"""One sample's scoring: call the function, never raise, check what it returned.

Shared by the in-process path and the forked workers, so both judge return values alike.
A result travels between processes as a plain tuple ``(score, extra, error, dropped,
traceback)``; :class:`ScoreResult` is what callers of the manager see.
"""

from __future__ import annotations

import math
import numbers
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ScoreResult", "coerce_result", "describe_fn", "score_one"]


def describe_fn(fn: Callable) -> str:
    """A short name for log lines: ``compute_score`` or ``compute_score from '/x/r.py'``."""
    return getattr(fn, "__qualname__", None) or repr(fn)


@dataclass
class ScoreResult:
    """The outcome for one sample.

    ``error`` is set (and ``score`` is 0.0) when the function raised, returned an invalid
    value, crashed its worker or timed out; ``timed_out`` tells the last case apart.
    ``extra`` holds the numeric extra metrics of a dict result (``{"acc": 1.0}``).
    """

    score: float
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


def _as_float(value: Any) -> float | None:
    """A finite float from a number (bool, int, float, numpy/torch scalar), else None."""
    if isinstance(value, str):
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def coerce_result(value: Any, index: int, fn_desc: str) -> tuple[float, dict, str | None, list[str]]:
    """Check a function's return value: (score, extra, error, dropped extra keys)."""
    raw = value.get("score", None) if isinstance(value, dict) else value
    score = _as_float(raw)
    if score is None:
        if isinstance(value, dict) and "score" not in value:
            why = f"a dict without a 'score' key (keys: {sorted(map(str, value))[:10]})"
        else:
            why = f"{raw!r:.80}" + (" (scores must be finite numbers)" if _is_nonfinite(raw) else "")
        error = (
            f"reward function {fn_desc} returned {why} for sample {index}; "
            "it must return a float or a dict with a 'score' key"
        )
        return 0.0, {}, error, []
    extra, dropped = {}, []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "score":
                continue
            number = _as_float(item)
            if number is None:
                dropped.append(str(key))
            else:
                extra[str(key)] = number
    return score, extra, None, dropped


def _is_nonfinite(value: Any) -> bool:
    """True for NaN/inf numbers (used only to word an error message)."""
    try:
        return isinstance(value, numbers.Real) and not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def score_one(fn: Callable, item: dict, index: int, fn_desc: str) -> tuple:
    """Call ``fn`` on one item; never raises. Returns (score, extra, error, dropped, traceback)."""
    try:
        value = fn(item["data_source"], item["solution_str"], item["ground_truth"], item.get("extra_info"))
    except Exception as exc:  # a scorer bug costs one sample, not the run
        last_line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return 0.0, {}, last_line, [], traceback.format_exc()
    return (*coerce_result(value, index, fn_desc), None)
