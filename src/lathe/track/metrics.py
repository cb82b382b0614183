"""Turning metric values into plain numbers, and reducing many of them into one per key.

Callers hand us Python numbers, numpy scalars/arrays, torch tensors (on any device) or lists of
those; every logger backend wants a plain ``float`` or ``int``. ``reduce_metrics`` mirrors verl's
``reduce_metrics``: keys whose last name part says ``max``/``min`` are reduced with max/min, every
other key with the mean over all values (lists and tensors are flattened first, so a micro-batch
list and a per-sample tensor reduce the same way).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["reduce_metrics", "to_scalar", "flatten_values"]


def flatten_values(value: Any) -> list[float]:
    """Every number inside ``value`` (scalar, tensor, array, or nested list) as a flat float list."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch at module load
        value = value.detach().float().cpu().numpy()
    if isinstance(value, np.ndarray):
        return [float(v) for v in value.reshape(-1)]
    if isinstance(value, bool | numbers.Number):
        return [float(value)]
    if isinstance(value, list | tuple):
        return [v for item in value for v in flatten_values(item)]
    raise TypeError(f"not a number: {type(value).__name__} {value!r:.60}")


def to_scalar(key: str, value: Any) -> float | int:
    """``value`` as one plain number for logging; a tensor/array/list of many numbers is averaged.

    Ints stay ints (counts read better in jsonl); bools become ints. Raises ``TypeError`` naming
    the key for values that hold no number (strings, dicts, empty lists).
    """
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        flat = flatten_values(value)
    except TypeError as err:
        raise TypeError(f"metric {key!r}: {err}; log a number, a tensor or a list of numbers") from None
    if not flat:
        raise TypeError(f"metric {key!r}: empty {type(value).__name__}; log at least one number")
    return flat[0] if len(flat) == 1 else float(np.mean(flat))


def _reduction(key: str) -> str:
    """verl's rule: ``max``/``min`` in the key's last part picks max/min, anything else the mean."""
    last = key.rsplit("/", 1)[-1]
    words = last.replace("@", "_").split("_")
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def _collect(metrics: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Group every number by key, from a dict of lists (verl) or a list of dicts (per micro-batch)."""
    groups: dict[str, list[float]] = {}
    items = [metrics] if isinstance(metrics, Mapping) else list(metrics)
    for i, row in enumerate(items):
        if not isinstance(row, Mapping):
            raise TypeError(f"reduce_metrics: item {i} is a {type(row).__name__}, expected a dict of metrics")
        for key, value in row.items():
            try:
                groups.setdefault(key, []).extend(flatten_values(value))
            except TypeError as err:
                raise TypeError(f"reduce_metrics: metric {key!r} in item {i}: {err}") from None
    return groups


def reduce_metrics(metrics: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """One float per key: mean of all values, or max/min for keys like ``response_length/max``.

    Accepts a list of dicts (``[{"actor/pg_loss": 0.1}, {"actor/pg_loss": 0.3}]``) or verl's dict
    of lists (``{"actor/pg_loss": [0.1, 0.3]}``); values may be floats, ints, tensors or lists.
    A key with no values at all reduces to NaN, as in verl.
    """
    out: dict[str, float] = {}
    for key, values in _collect(metrics).items():
        if not values:
            out[key] = math.nan
            continue
        how = _reduction(key)
        out[key] = float(max(values) if how == "max" else min(values) if how == "min" else np.mean(values))
    return out
