"""MATH-style rule scorer: the last ``\\boxed{...}`` answer, checked against the truth with math-verify.

The answer is the content of the LAST ``\\boxed{}`` (or ``\\fbox{}``; nested braces allowed), as in verl's
``math.py`` / ``math_dapo.py`` scorers and as the MATH prompts ask. Equivalence is decided by the maintained
`math-verify` library (Hugging Face): both sides are parsed from LaTeX into sympy and compared as values,
expressions, sets, intervals, tuples or equations, so ``0.5`` matches ``\\frac{1}{2}``, ``\\sqrt{8}`` matches
``2\\sqrt{2}``, ``x = 5`` matches ``5`` and ``10\\text{ cm}^2`` matches ``10``; numbers compare to 6 decimals.
Identical strings match without parsing. math-verify's own timeouts use SIGALRM, which only the main thread may
set: elsewhere the comparison runs without one (lathe's scoring workers bound every sample's time themselves).
"""

from __future__ import annotations

import re
import threading

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_TIMEOUT_S = 5


def last_boxed_only_string(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The brace-less
    form ``\\boxed 5`` gives ``5``. None when there is no box or its braces never close.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith(" "):
        return re.split(r"[$\s]", rest.lstrip(" "), maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None


_FORMATTED = re.compile(r"\\(?:textbf|mathbf|text|mathrm)\{(.*)\}")


def _unformatted(answer: str) -> str:
    """The answer without formatting around all of it (AoPS writes AIME answers as ``\\textbf{(073)}``)."""
    answer = answer.strip()
    while (m := _FORMATTED.fullmatch(answer)) is not None:
        answer = m.group(1).strip()
    return answer


def is_equiv(pred: str | None, truth: str | None) -> bool:
    """True when two LaTeX answers denote the same thing (math-verify), or are the same string."""
    if pred is None or truth is None:
        return False
    pred, truth = _unformatted(pred), _unformatted(truth)
    if pred == truth:
        return True
    from math_verify import parse, verify
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${truth}$", parsing_timeout=timeout)
    answer = parse(f"${pred}$", parsing_timeout=timeout)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=timeout))


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer in ``solution_str`` equals ``ground_truth``, else 0.0.

    A ``ground_truth`` that itself contains ``\\boxed{}`` is unboxed first.
    """
    pred = last_boxed_only_string(solution_str)
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = last_boxed_only_string(truth) or truth
    return 1.0 if is_equiv(pred, truth) else 0.0
