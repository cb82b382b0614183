"""Scorer for lathe's built-in arithmetic task (``data_source="lathe/arithmetic"``).

The task asks for a bare answer (``"12 + 30 ="`` -> ``"42"``), so the check is an exact
match after stripping surrounding whitespace on both sides. The caller has already
removed special tokens (EOS, padding) from the decoded response.
"""

from __future__ import annotations

__all__ = ["compute_score"]


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """1.0 when ``solution_str.strip() == str(ground_truth).strip()``, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
