"""``default_compute_score``: pick a rule scorer from the sample's ``data_source``.

Mirrors verl's ``verl.utils.reward_score.default_compute_score``: the parquet column
``data_source`` names the data set, and each known data set has a rule scorer. Data sets
without one need a custom function (``reward.custom_reward_function.path=...``).
"""

from __future__ import annotations

from typing import Any, Callable

from lathe.reward import builtin, code, geo3k, gsm8k
from lathe.reward import math as math_score

__all__ = ["GSM8K_SOURCES", "MATH_SOURCES", "MATH_PREFIXES", "ARITHMETIC_SOURCES", "default_compute_score", "scorer_for"]

GSM8K_SOURCES = frozenset({"openai/gsm8k", "gsm8k"})
MATH_SOURCES = frozenset({
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math500",
    "math_dapo",
    "math",
})
# Competition sets whose answers are boxed numbers: aime24, aime25, amc23, ...
MATH_PREFIXES = ("aime", "amc")
ARITHMETIC_SOURCES = frozenset({"lathe/arithmetic"})


def scorer_for(data_source: str) -> Callable[[str, Any], float]:
    """Return the rule scorer ``fn(solution_str, ground_truth) -> float`` for a data source (the agent task's:
    ``fn(solution_str, ground_truth, extra_info)``).

    Raises NotImplementedError (as verl does) naming the data source and the fix.
    """
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score
    if data_source in MATH_SOURCES or str(data_source).lower().startswith(MATH_PREFIXES):
        return math_score.compute_score
    if data_source in ARITHMETIC_SOURCES:
        return builtin.compute_score
    if data_source in builtin.SECRET_LOOKUP_SOURCES:
        return builtin.tool_verdict             # fn(solution_str, ground_truth, extra_info): a tool's verdict
    if data_source in code.CODE_SOURCES:
        return code.compute_score
    if data_source in geo3k.DATA_SOURCES:
        return geo3k.compute_score
    known = sorted(GSM8K_SOURCES | MATH_SOURCES | ARITHMETIC_SOURCES | builtin.SECRET_LOOKUP_SOURCES
                   | code.CODE_SOURCES | geo3k.DATA_SOURCES)
    known += [p + "*" for p in MATH_PREFIXES]
    raise NotImplementedError(
        f"no built-in reward function for data_source={data_source!r} (built-in: {', '.join(known)}); "
        "write one as compute_score(data_source, solution_str, ground_truth, extra_info=None) "
        "and pass reward.custom_reward_function.path=/path/to/file.py"
    )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Score one response with the built-in scorer for its ``data_source``.

    ``extra_info`` reaches only the scorers that read it (the agent task's tool verdict); the others ignore it.
    """
    scorer = scorer_for(data_source)
    if data_source in builtin.SECRET_LOOKUP_SOURCES:
        return float(scorer(solution_str, ground_truth, extra_info))
    return float(scorer(solution_str, ground_truth))
