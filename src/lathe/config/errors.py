"""ConfigError and the "did you mean" helper shared by the config package.

Every config problem is reported as a ``ConfigError`` whose message names the key(s), the bad
value, the rule that was broken and how to fix it, so a user never has to read lathe's source to
understand why a run refused to start.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config key, value or combination of values is invalid (message says which and the fix)."""


def closest(word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Return up to ``n`` candidates closest to ``word`` (difflib ratio), best first."""
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=cutoff)


def did_you_mean(options: list[str]) -> str:
    """Format suggestions as ' Did you mean `a`?' / ' Did you mean `a` or `b`?' ('' when none)."""
    if not options:
        return ""
    quoted = [f"`{o}`" for o in options]
    if len(quoted) == 1:
        return f" Did you mean {quoted[0]}?"
    return f" Did you mean {', '.join(quoted[:-1])} or {quoted[-1]}?"


def join_problems(problems: list[str], what: str = "config problems") -> str:
    """One problem as-is; several as a numbered list under a count line ("<n> <what>:")."""
    if len(problems) == 1:
        return problems[0]
    lines = [f"{len(problems)} {what}:"]
    lines += [f"  {i}. {p}" for i, p in enumerate(problems, 1)]
    return "\n".join(lines)


class ProblemList:
    """Collects problem messages so that one ConfigError can list all of them at once."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, message: str) -> None:
        """Record one problem (a full sentence naming key, value, rule and fix); duplicates are dropped."""
        if message not in self.problems:
            self.problems.append(message)

    def raise_if_any(self, context: str = "") -> None:
        """Raise one ConfigError listing every recorded problem, if there are any."""
        if not self.problems:
            return
        text = join_problems(self.problems)
        raise ConfigError(f"{context}{text}" if context else text)


class IgnoredKeysWarning(UserWarning):
    """Config keys were set that have no effect in lathe, or that lathe reads otherwise than verl (the message lists
    them and why). Defined here, below the support registry, so translations can warn with it too."""
