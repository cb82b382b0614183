"""lathe.reward.geo3k: verl's geo3k weighting (0.9 accuracy + 0.1 format) and the data_source registration."""

import pytest

from lathe.reward import default_compute_score
from lathe.reward.geo3k import acc_reward, compute_score, format_reward
from lathe.reward.registry import scorer_for

GOOD = "<think>The triangle is isosceles, so x = 3.</think> The answer is \\boxed{3}."


def test_correct_and_formatted_scores_one():
    assert compute_score(GOOD, "3") == pytest.approx(1.0)


def test_wrong_answer_keeps_the_format_score():
    assert compute_score(GOOD.replace("{3}", "{4}"), "3") == pytest.approx(0.1)


def test_correct_answer_without_think_block_scores_point_nine():
    assert compute_score("x = 3, so \\boxed{3}", "3") == pytest.approx(0.9)


def test_no_box_and_no_format_scores_zero():
    assert compute_score("<think>hm</think> the answer is 3", "3") == 0.0
    assert compute_score("", "3") == 0.0


def test_format_needs_think_then_box_and_spans_lines():
    assert format_reward("<think>a\nb</think>\n\\boxed{1}\n") == 1.0
    assert format_reward("\\boxed{1}<think>a</think>") == 0.0          # box before the think block
    assert format_reward("<think>a</think> 1") == 0.0


def test_accuracy_uses_the_last_box_and_math_equivalence():
    assert acc_reward("\\boxed{1} then \\boxed{2\\sqrt{3}}", "\\sqrt{12}") == 1.0
    assert acc_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert acc_reward("\\boxed{6}", "3") == 0.0
    assert acc_reward("3", "3", use_boxed=False) == 1.0


def test_registry_maps_geometry3k_to_the_scorer():
    assert scorer_for("hiyouga/geometry3k") is compute_score
    assert default_compute_score("hiyouga/geometry3k", GOOD, "3") == pytest.approx(1.0)
