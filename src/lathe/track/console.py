"""What a person watching the terminal sees: one short line per step (and, on a terminal, the live line of
`lathe.track.progress` below it).

The line picks the handful of verl metrics that tell whether a run is healthy, in a fixed order,
and skips those that are absent; every metric still goes to ``metrics.jsonl`` and the other
loggers. ``reward`` is left out when it reads the same as ``score`` (no KL penalty in the reward).
Example::

    step 12/60 | score 0.62 | pg_loss -0.013 | kl 0.0012 | entropy 1.23 | resp_len 4.1 | gen 0.41s | step 1.20s | 3.2k tok/s | eta 58s
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from lathe.track.metrics import to_scalar
from lathe.track.progress import duration

__all__ = ["format_step_line", "brief"]

# (label, candidate keys in order of preference, kind). kinds: "num", "sec", "rate".
_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("score", ("pf_ppo/score_before/mean", "critic/score/mean"), "num"),   # PF-PPO: the sampled, not the redrawn
    ("tool_calls", ("agent/tool_calls/mean",), "num"),   # multi-turn: tool calls per trajectory
    ("reward", ("critic/rewards/mean",), "num"),
    ("pg_loss", ("actor/pg_loss",), "num"),
    ("vf_loss", ("critic/vf_loss",), "num"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty"), "num"),
    ("entropy", ("actor/entropy",), "num"),
    ("loss", ("train/loss",), "num"),                  # lathe sft
    ("val_loss", ("val/loss",), "num"),
    ("grad_norm", ("actor/grad_norm", "train/grad_norm"), "num"),
    ("resp_len", ("response_length/mean",), "num"),
    ("gen", ("timing_s/gen",), "sec"),
    ("step", ("timing_s/step",), "sec"),
    ("tok/s", ("perf/throughput",), "rate"),
)
_VAL_KEY = re.compile(r"^val-core/(?P<source>.+)/reward/mean@(?P<n>\d+)$")


def _num(v: float) -> str:
    """About three significant digits, never in exponent form for everyday magnitudes."""
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    if abs(v) < 1e-4:
        return f"{v:.1e}"
    return f"{v:.3g}"


def _sec(v: float) -> str:
    return f"{v:.2f}s" if v < 10 else f"{v:.1f}s" if v < 100 else f"{v:.0f}s"


def _rate(v: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.1f}{suffix}"
    return f"{v:.0f}"


def _value(metrics: Mapping[str, Any], key: str) -> float | None:
    try:
        return float(to_scalar(key, metrics[key]))
    except (KeyError, TypeError):
        return None


def _val_parts(metrics: Mapping[str, Any]) -> list[str]:
    """``val[<data_source>] x`` per data source, from its largest-n ``val-core/.../reward/mean@n``."""
    best: dict[str, tuple[int, str]] = {}
    for key in metrics:
        m = _VAL_KEY.match(key)
        if m and int(m["n"]) >= best.get(m["source"], (-1, ""))[0]:
            best[m["source"]] = (int(m["n"]), key)
    parts = []
    for source, (_, key) in sorted(best.items()):
        v = _value(metrics, key)
        if v is not None:
            parts.append(f"val[{source}] {_num(v)}")
    return parts


def _field(metrics: Mapping[str, Any], keys: tuple[str, ...]) -> float | None:
    return next((x for x in (_value(metrics, k) for k in keys if k in metrics) if x is not None), None)


def format_step_line(step: int, total: int | None, metrics: Mapping[str, Any], eta_s: float | None = None) -> str:
    """One readable line: ``step s/total``, the important metrics present, then ``eta`` when given;
    ``|``-separated."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    shown: dict[str, str] = {}
    for label, keys, kind in _FIELDS:
        v = _field(metrics, keys)
        if v is None:
            continue
        if kind == "sec":
            parts.append(f"{label} {_sec(v)}")
        elif kind == "rate":
            parts.append(f"{_rate(v)} {label}")
        elif label == "reward" and shown.get("score") == _num(v):
            continue                            # the reward is the score: no KL penalty, nothing to tell apart
        else:
            shown[label] = _num(v)
            parts.append(f"{label} {_num(v)}")
    parts.extend(_val_parts(metrics))
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return " | ".join(parts)


def brief(metrics: Mapping[str, Any]) -> str:
    """The one figure the live line shows beside the step count: the score (RL) or the loss (SFT)."""
    for label, keys in (("score", ("critic/score/mean",)), ("loss", ("train/loss",))):
        v = _field(metrics, keys)
        if v is not None:
            return f"{label} {_num(v)}"
    return ""
