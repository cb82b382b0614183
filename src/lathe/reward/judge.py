"""A generative judge's text side: the judge prompt, the verdict parser, and the verdict combined with a rule score.

Text in, numbers out (`lathe.workers.judge` runs the judge model). Keys: `reward_model.judge.*`
(`lathe.config.schema_judge`).

* `render_prompt`: `{question}`, `{response}` and `{ground_truth}` of the template replaced by the row's text;
  nothing else of the template changes (a literal `\\boxed{}` needs no escaping).
* `parse_verdict`: `score` reads the answer's last number, `boxed` its last `\\boxed{...}` (a number, or one of the
  labels), `label` the last of the labels' words (whole word, any case). A number must lie in `[low, high]`
  and becomes `(x - low) / (high - low)`; a label gives its value as written. Anything else is None: a parse
  failure, which the caller scores with `default_score` and counts.
* `combine_scores`: `judge` (the verdict alone), `sum` (rule + weight x verdict), `product` (rule x verdict).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from lathe.reward.math import last_boxed_only_string

PLACEHOLDERS = ("{question}", "{response}", "{ground_truth}")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class VerdictSpec:
    """How a verdict is read: `parser` (score | boxed | label), the numeric range and the labels' scores."""

    parser: str = "score"
    low: float = 0.0
    high: float = 10.0
    labels: dict[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})


def render_prompt(template: str, *, question: str, response: str, ground_truth: str | None) -> str:
    """The judge's prompt of one row: the three placeholders replaced in one pass (a response that itself holds
    `{question}` is not rendered again); a missing ground truth is empty text."""
    values = {"{question}": question, "{response}": response,
              "{ground_truth}": "" if ground_truth is None else str(ground_truth)}
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: values[m.group(0)], template)


def question_of(raw_prompt) -> str:
    """The question a judge sees: a chat prompt's last user message (the whole text of a plain-text prompt)."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m for m in raw_prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError("reward_model.judge: a prompt without a user message has no question to show the judge")
    content = users[-1].get("content")
    if not isinstance(content, str):
        raise NotImplementedError("reward_model.judge.enable=true with image prompts: lathe's judge reads text only. "
                                  "Fix: train on text prompts, or set reward_model.judge.enable=false")
    return content


def parse_verdict(text: str, spec: VerdictSpec) -> float | None:
    """The verdict's score (see the module docstring), or None when it does not parse."""
    if spec.parser == "score":
        numbers = _NUMBER.findall(text)
        return _normalised(numbers[-1], spec) if numbers else None
    if spec.parser == "boxed":
        boxed = last_boxed_only_string(text)
        if boxed is None:
            return None
        boxed = boxed.strip()
        if _NUMBER.fullmatch(boxed):
            return _normalised(boxed, spec)
        return _label_value(boxed.lower(), spec.labels)
    if spec.parser == "label":
        return _last_label(text, spec.labels)
    raise ValueError(f"reward_model.judge.parser={spec.parser!r}: use score, boxed or label")


def _normalised(number: str, spec: VerdictSpec) -> float | None:
    x = float(number)
    if not math.isfinite(x) or not spec.low <= x <= spec.high:
        return None
    return (x - spec.low) / (spec.high - spec.low)


def _label_value(word: str, labels: dict[str, float]) -> float | None:
    for label, value in labels.items():
        if label.lower() == word:
            return float(value)
    return None


def _last_label(text: str, labels: dict[str, float]) -> float | None:
    """The value of the label that occurs last in `text` (whole words, any case)."""
    best, where = None, -1
    for label, value in labels.items():
        for m in re.finditer(rf"(?<!\w){re.escape(label)}(?!\w)", text, flags=re.IGNORECASE):
            if m.start() > where:
                best, where = float(value), m.start()
    return best


def combine_scores(rule: list[float] | None, verdicts: list[float], mode: str, weight: float) -> list[float]:
    """The reward of each row from its rule score and its judge's verdict (`reward_model.judge.combine`)."""
    if mode == "judge":
        return list(verdicts)
    if rule is None or len(rule) != len(verdicts):
        raise ValueError(f"reward_model.judge.combine={mode}: needs one rule score per verdict")
    if mode == "sum":
        return [r + weight * v for r, v in zip(rule, verdicts)]
    if mode == "product":
        return [r * v for r, v in zip(rule, verdicts)]
    raise ValueError(f"reward_model.judge.combine={mode!r}: use judge, sum or product")
