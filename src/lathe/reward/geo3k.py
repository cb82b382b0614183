"""Geometry3K scorer (``data_source="hiyouga/geometry3k"``), with the semantics of verl's ``reward_score/geo3k.py``.

score = (1 - format_score) * accuracy + format_score * format, with format_score = 0.1:

* format (0 or 1): the whole response matches ``<think>...</think>...\\boxed{...}...`` (dot matches newlines);
* accuracy (0 or 1): the content of the last ``\\boxed{}`` equals the ground truth. verl grades with mathruler's
  ``grade_answer``; lathe uses its math-verify comparison (`lathe.reward.math.is_equiv`), which accepts the same
  equal answers (``3`` vs ``3.0``, ``\\frac{1}{2}`` vs ``0.5``, ``2\\sqrt{3}`` vs ``\\sqrt{12}``).

So a correct, well-formatted response scores 1.0, a correct answer without the think block 0.9, a well-formatted
wrong answer 0.1, and anything else 0.0.
"""

from __future__ import annotations

import re

from lathe.reward.math import is_equiv, last_boxed_only_string

__all__ = ["DATA_SOURCES", "FORMAT_SCORE", "acc_reward", "compute_score", "format_reward"]

DATA_SOURCES = frozenset({"hiyouga/geometry3k", "geo3k"})
FORMAT_SCORE = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    """1.0 when the response is ``<think>...</think>`` then (somewhere after) a ``\\boxed{...}``, else 0.0."""
    return 1.0 if _FORMAT.fullmatch(solution_str) else 0.0


def acc_reward(solution_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when the last boxed answer (or the whole response, with use_boxed=False) equals ``ground_truth``."""
    answer = last_boxed_only_string(solution_str) if use_boxed else solution_str
    return 1.0 if is_equiv(answer.strip() if answer else answer, str(ground_truth).strip()) else 0.0


def compute_score(solution_str: str, ground_truth: str, use_boxed: bool = True,
                  format_score: float = FORMAT_SCORE) -> float:
    """(1 - format_score) * acc_reward + format_score * format_reward; a float in [0, 1]."""
    return (1.0 - format_score) * acc_reward(solution_str, ground_truth, use_boxed) \
        + format_score * format_reward(solution_str)
