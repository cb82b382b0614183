"""The top-k/top-p rule written out in float64 with Python loops: the reference both samplers are tested against."""

from __future__ import annotations

import math


def kept_reference(x: list[float], temperature: float, top_k: int, top_p: float) -> list[bool]:
    """Which tokens of logits `x` top-k then top-p keep. Top-k (0 < k < V) keeps every token at or above the k-th
    largest value; top-p (p < 1) then keeps a token when the kept tokens strictly larger than it hold less than `p`
    of the kept mass (softmax at `temperature`): tokens of equal value are kept or dropped together."""
    v = len(x)
    keep = [True] * v
    if 0 < top_k < v:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [xi >= kth for xi in x]
    if top_p < 1:
        top = max(x)
        group: dict[float, float] = {}
        for xi, kept in zip(x, keep):
            if kept:
                group[xi] = group.get(xi, 0.0) + math.exp((xi - top) / temperature)
        total, above, values = sum(group.values()), 0.0, set()
        for value in sorted(group, reverse=True):
            if above < top_p * total:
                values.add(value)
            above += group[value]
        keep = [kept and xi in values for xi, kept in zip(x, keep)]
    return keep
