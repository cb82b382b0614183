"""Line charts as inline SVG: step on x, one polyline per series, ticks, and a hover title on every point.

A NaN or infinite value breaks its line and is marked by a red triangle on the x axis (hover: the value);
a step where a series has no value (e.g. validation every few steps) is bridged.
"""

from __future__ import annotations

import math
from html import escape


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
WIDTH, HEIGHT = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 10, 38
MAX_MARKERS = 400       # points per series drawn as hoverable dots; a longer series is a bare line

Series = dict[str, list[tuple[int, float]]]


def fmt(v: float) -> str:
    """A tick or hover value: about four significant digits, no exponent for everyday magnitudes."""
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e6:
        return f"{v:.4g}"
    return f"{v:.2e}"


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round values (1, 2, 2.5 or 5 x 10^k apart), about ``count`` of them, within [lo, hi]."""
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(i * step, 12) for i in range(first, math.floor(hi / step + 1e-9) + 1)]


def _bounds(values: list[float], pad: float) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi)):       # constant, up to rounding
        spread = abs(hi) * 0.1
        return (lo - spread, hi + spread) if spread else (-0.05, 1.0)
    margin = (hi - lo) * pad
    return lo - margin, hi + margin


def line_chart(series: Series, *, title: str = "", y_label: str = "") -> str:
    """One ``<svg>``; ``series`` maps a metric name to its (step, value) points in step order."""
    points = [p for pts in series.values() for p in pts]
    good = [v for _, v in points if math.isfinite(v)]
    x0, x1 = _bounds([float(s) for s, _ in points], 0.02)
    y0, y1 = _bounds(good or [0.0], 0.06)
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * pw

    def y(value: float) -> float:
        return TOP + (y1 - value) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
           f'height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="area"/>']
    for t in nice_ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>'
                   f'<text x="{LEFT - 5}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for t in nice_ticks(x0, x1):
        if t == int(t):       # steps are whole numbers
            out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" y2="{TOP + ph}" class="grid"/>'
                       f'<text x="{x(t):.1f}" y="{TOP + ph + 15}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 4}" text-anchor="middle" class="label">step</text>')
    if y_label:
        out.append(f'<text transform="translate(12 {TOP + ph / 2}) rotate(-90)" text-anchor="middle" '
                   f'class="label">{escape(y_label)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        out += _series(name, pts, PALETTE[i % len(PALETTE)], i % 2 == 1, x, y, TOP + ph)
    out.append("</svg>")
    return "\n".join(out)


def _series(name: str, pts: list[tuple[int, float]], colour: str, dashed: bool, x, y, floor: float) -> list[str]:
    """Polylines between non-finite values (every other series dashed, so equal series both show), a dot with a
    title per point, a red mark per NaN/inf."""
    out, run = [], []
    for step, v in pts + [(0, math.nan)]:             # the sentinel closes the last run
        if math.isfinite(v):
            run.append(f"{x(step):.1f},{y(v):.1f}")
        elif run:
            dash = ' stroke-dasharray="7 4"' if dashed else ""
            out.append(f'<polyline points="{" ".join(run)}" stroke="{colour}"{dash} class="line"/>')
            run = []
    label = escape(name)
    markers = len(pts) <= MAX_MARKERS
    for step, v in pts:
        if not math.isfinite(v):
            out.append(f'<path d="M{x(step):.1f} {floor - 9}l-4.5 8h9z" class="bad"><title>{label} at step {step}: '
                       f"{v}</title></path>")
        elif markers:
            out.append(f'<circle cx="{x(step):.1f}" cy="{y(v):.1f}" r="2.6" fill="{colour}">'
                       f"<title>{label} at step {step}: {fmt(v)}</title></circle>")
    return out
