"""What a person watching the terminal sees: one short line per step, and an optional progress bar.

The line picks the handful of verl metrics that tell whether a run is healthy, in a fixed order,
and skips those that are absent; every metric still goes to ``metrics.jsonl`` and the other
loggers. Example::

    step 12/60 | score 0.62 | pg_loss -0.013 | kl 0.0012 | entropy 1.23 | resp_len 4.1 | gen 0.41s | step 1.20s | 3.2k tok/s
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from lathe.track.metrics import to_scalar

__all__ = ["format_step_line", "ProgressBar"]

# (label, candidate keys in order of preference, kind). kinds: "num", "sec", "rate".
_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("score", ("critic/score/mean",), "num"),
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


def format_step_line(step: int, total: int | None, metrics: Mapping[str, Any]) -> str:
    """One readable line: ``step s/total`` then the important metrics present, ``|``-separated."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for label, keys, kind in _FIELDS:
        v = next((x for x in (_value(metrics, k) for k in keys if k in metrics) if x is not None), None)
        if v is None:
            continue
        if kind == "sec":
            parts.append(f"{label} {_sec(v)}")
        elif kind == "rate":
            parts.append(f"{_rate(v)} {label}")
        else:
            parts.append(f"{label} {_num(v)}")
    parts.extend(_val_parts(metrics))
    return " | ".join(parts)


class ProgressBar:
    """A tqdm bar over training steps that starts at the resumed step and shows the latest score.

    Disabled (every method a no-op, ``write`` still prints) when ``file`` is not a terminal, so
    log files and CI output stay free of carriage-return noise; ``force=True`` turns it on anyway.
    Text printed through ``write`` goes through ``tqdm.write`` so it never tears the bar.
    """

    def __init__(
        self,
        total: int | None,
        initial: int = 0,
        *,
        desc: str = "train",
        force: bool = False,
        file: TextIO | None = None,
    ) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.file = file if file is not None else sys.stdout
        is_tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.enabled = force or is_tty
        self.bar = (
            tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.file, dynamic_ncols=True)
            if self.enabled
            else None
        )

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to ``step`` (absolute, so resume and skipped steps stay right); show the score."""
        if self.bar is None:
            return
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        score = _value(metrics or {}, "critic/score/mean")
        if score is not None:
            self.bar.set_postfix_str(f"score {_num(score)}", refresh=True)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar (plain print to ``file`` when the bar is off)."""
        self._tqdm.write(line, file=self.file)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
