"""GSM8K rule scorer, behaving like verl's ``verl/utils/reward_score/gsm8k.py``.

A GSM8K reference solution ends with ``#### <number>``; verl's preprocessing stores that
number (commas removed) as ``reward_model.ground_truth``. A response is scored by pulling
one number out of its text and comparing strings:

* ``strict``: the number after the LAST ``#### `` marker (this also rewards the format;
  ``#### $1,200`` reads as ``1200``);
* ``flexible``: the last number anywhere in the text (a sentence's final ``.`` dropped).

As in verl, only the tail of a long response is searched (the answer comes last, and
regexes over very long strings are slow).
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_solution"]

# Search only the last characters of a response: the final answer is at the end, and this
# bounds the regex cost on runaway generations. Same figure as verl.
_SOLUTION_CLIP_CHARS = 300

# verl's pattern, plus an optional "$" after the marker ("#### $1,200").
_STRICT_RE = re.compile(r"#### \$?(\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")


def _clean_number(text: str) -> str:
    """Drop thousands separators and dollar signs: ``$1,200`` -> ``1200``."""
    return text.replace(",", "").replace("$", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """Return the answer string found in ``solution_str``, or None when there is none.

    ``method`` is ``"strict"`` (last ``#### <number>``) or ``"flexible"`` (last number).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method={method!r} is not known; use 'strict' or 'flexible'")
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        return _clean_number(matches[-1]) if matches else None
    for candidate in reversed(_NUMBER_RE.findall(tail)):
        if candidate not in ("", ".", ",") and any(ch.isdigit() for ch in candidate):
            return _clean_number(candidate).rstrip(".")  # "is 42." ends a sentence
    return None


def compute_score(
    solution_str: str,
    ground_truth: str | int | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score one GSM8K response.

    Returns ``score`` when the extracted answer equals ``ground_truth``, ``format_score``
    when an answer was found but is wrong, and 0.0 when no answer was found. The ground
    truth is cleaned like the answer (``"1,200"`` and ``1200`` both match ``#### 1,200``).
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = _clean_number(str(ground_truth).strip())
    return float(score) if answer == truth else float(format_score)
