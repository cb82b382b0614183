import math

import numpy as np
import pytest

from lathe.reward.scoring import describe_fn, score_one

ITEM = {"data_source": "src", "solution_str": "s", "ground_truth": "g", "extra_info": None}


def _run(value):
    return score_one(lambda *args: value, ITEM, 3, "fn")


@pytest.mark.parametrize("value, expected", [(0.25, 0.25), (2, 2.0), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5)])
def test_numbers_and_bools_are_scores(value, expected):
    score, extra, error, dropped, _ = _run(value)
    assert (score, extra, error, dropped) == (expected, {}, None, [])


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("abc", "'abc'"),
        (None, "None"),
        ([1.0], "[1.0]"),
        (float("nan"), "nan (scores must be finite numbers)"),
        (math.inf, "inf (scores must be finite numbers)"),
        ({"acc": 1.0}, "without a 'score' key (keys: ['acc'])"),
        ({"score": "1"}, "returned '1'"),
    ],
)
def test_invalid_returns_are_errors_that_name_the_value_and_sample(value, fragment):
    score, extra, error, _, _ = _run(value)
    assert score == 0.0 and extra == {}
    assert fragment in error
    assert "for sample 3" in error and "dict with a 'score' key" in error


def test_the_brief_example_message():
    _, _, error, _, _ = _run("abc")
    assert error.startswith("reward function fn returned 'abc' for sample 3; it must return a float")


def test_dict_extras_keep_numbers_and_drop_the_rest():
    score, extra, error, dropped, _ = _run({"score": 1, "acc": True, "len": np.int64(4), "pred": "x", "bad": math.nan})
    assert score == 1.0 and error is None
    assert extra == {"acc": 1.0, "len": 4.0}
    assert sorted(dropped) == ["bad", "pred"]


def test_a_raise_becomes_the_traceback_last_line():
    def boom(*args):
        raise ZeroDivisionError("no way")

    score, _, error, _, tb = score_one(boom, ITEM, 0, "boom")
    assert score == 0.0 and error == "ZeroDivisionError: no way"
    assert "Traceback" in tb and "boom" in tb


def test_describe_fn():
    def compute_score():
        pass

    assert describe_fn(compute_score).endswith("compute_score")
