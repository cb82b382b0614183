"""Tests for lathe.config.errors: suggestion formatting and problem collection."""

import pytest

from lathe.config import ConfigError
from lathe.config.errors import ProblemList, closest, did_you_mean, join_problems


def test_closest_and_did_you_mean():
    assert closest("adv_estimatr", ["adv_estimator", "gamma", "lam"]) == ["adv_estimator"]
    assert did_you_mean([]) == ""
    assert did_you_mean(["a"]) == " Did you mean `a`?"
    assert did_you_mean(["a", "b", "c"]) == " Did you mean `a`, `b` or `c`?"


def test_problem_list_numbers_and_dedupes():
    problems = ProblemList()
    problems.raise_if_any()  # nothing recorded: no error
    problems.add("first")
    problems.add("second")
    problems.add("first")
    with pytest.raises(ConfigError) as err:
        problems.raise_if_any("ctx: ")
    text = str(err.value)
    assert text.startswith("ctx: 2 config problems")
    assert "1. first" in text and "2. second" in text
    assert join_problems(["only"]) == "only"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
