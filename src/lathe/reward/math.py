"""MATH-style rule scorer: last ``\\boxed{...}`` answer, normalised, compared to the truth.

Behaves in the spirit of verl's ``math.py`` (Hendrycks' MATH normaliser) and
``math_dapo.py``: the answer is the content of the LAST ``\\boxed{}`` (nested braces
allowed), both sides are normalised as strings (``\\left``/``\\right``, spaces, ``\\!``,
trailing unit ``\\text{...}``, ``dfrac`` -> ``frac``, ``\\frac12`` -> ``\\frac{1}{2}``,
``a/b`` -> ``\\frac{a}{b}``, trailing ``.0``, degrees, dollars, percent, ``x =`` ...), and
when both sides are plain numbers (integers, decimals, ``\\frac{a}{b}``) they are also
compared exactly as fractions, so ``0.5`` matches ``\\frac{1}{2}``. No symbolic algebra:
equal-but-differently-written expressions (``2\\sqrt{2}`` vs ``\\sqrt{8}``) score 0.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "strip_string"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A unit word (or words) in \text{}/\mbox{}/\mathrm{} at the very end, maybe squared/cubed.
_RIGHT_UNIT_RE = re.compile(r"^(.+?)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?$")
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|mathbf)\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"-?\d+(?:\.\d+)?")
_FRAC_RE = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")


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


def _fix_fracs(s: str) -> str:
    """Add braces to shorthand fractions: ``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{7}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _remove_right_units(s: str) -> str:
    """Drop a trailing unit such as ``\\text{ cm}^2`` or ``\\mbox{ inches}`` after a value."""
    m = _RIGHT_UNIT_RE.match(s)
    return m.group(1) if m and m.group(1).strip() else s


def _strip_latex_noise(s: str) -> str:
    """Remove spacing, sizing and display-only LaTeX that never changes a value."""
    for old, new in (
        ("\n", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", " "),
        ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""),
        ("\\displaystyle", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\degree", ""),
        ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("{,}", ""),
        ("\\neq", "\\ne"), ("\\leq", "\\le"), ("\\geq", "\\ge"), ("bmatrix", "pmatrix"),
    ):
        s = s.replace(old, new)
    return s.strip()


def strip_string(answer: str) -> str:
    """Normalise a LaTeX answer string so equal answers compare equal as strings."""
    s = _strip_latex_noise(str(answer).strip())
    s = s.rstrip(".").strip()
    s = _remove_right_units(s)
    while (unwrapped := _WRAPPER_RE.sub(r"\1", s)) != s:
        s = unwrapped
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs  # "x = 5" -> "5", "k=3" -> "3"
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(\d)\.0+(?!\d)", r"\1", s)  # 5.0 -> 5, 2.00x -> 2x
    s = _fix_fracs(s)
    return _fix_a_slash_b(s)


def _as_number(s: str) -> Fraction | None:
    """Exact value of a normalised plain number (``-3``, ``0.25``, ``\\frac{1}{4}``), else None."""
    if _DECIMAL_RE.fullmatch(s):
        return Fraction(s)
    m = _FRAC_RE.fullmatch(s)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    return None


def is_equiv(pred: str | None, truth: str | None) -> bool:
    """True when two answers are the same after normalisation (or the same number)."""
    if pred is None or truth is None:
        return False
    a, b = strip_string(pred), strip_string(truth)
    if a == b:
        return True
    num_a, num_b = _as_number(a), _as_number(b)
    return num_a is not None and num_a == num_b


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer in ``solution_str`` equals ``ground_truth``, else 0.0.

    A ``ground_truth`` that itself contains ``\\boxed{}`` is unboxed first.
    """
    pred = last_boxed_only_string(solution_str)
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = last_boxed_only_string(truth) or truth
    return 1.0 if is_equiv(pred, truth) else 0.0
