import re

import pytest

from lathe.reward.gsm8k import compute_score, extract_solution


def _truth(answer: str) -> str:
    """verl's preprocessing: the number after '####', commas removed."""
    return answer.split("####")[-1].strip().replace(",", "")


def _change_final_number(answer: str) -> str:
    head, _, number = answer.rpartition("#### ")
    digits = number.strip().replace(",", "")
    changed = str(int(float(digits)) + 1) if digits.lstrip("-").replace(".", "").isdigit() else digits + "1"
    return f"{head}#### {changed}"


@pytest.mark.parametrize("split", ["test", "train"])
def test_every_reference_solution_scores_one_and_a_changed_answer_zero(split, load_jsonl):
    rows = load_jsonl(f"gsm8k/{split}.jsonl")
    wrong = [r["answer"] for r in rows if compute_score(r["answer"], _truth(r["answer"])) != 1.0]
    assert wrong == []
    right = [r["answer"] for r in rows if compute_score(_change_final_number(r["answer"]), _truth(r["answer"])) != 0.0]
    assert right == []


def test_strict_takes_the_last_marker_and_strips_commas_and_dollars():
    text = "first guess #### 12\nthen I fixed it\n#### $1,234"
    assert extract_solution(text) == "1234"
    assert compute_score(text, "1234") == 1.0
    assert compute_score(text, "12") == 0.0


def test_strict_needs_the_marker_flexible_does_not():
    text = "so the answer is 42."
    assert compute_score(text, "42") == 0.0
    assert compute_score(text, "42", method="flexible") == 1.0
    assert extract_solution("no numbers here", method="flexible") is None


def test_format_score_for_a_wrong_but_well_formed_answer():
    assert compute_score("#### 7", "8", format_score=0.1) == pytest.approx(0.1)
    assert compute_score("no marker", "8", format_score=0.1) == 0.0
    assert compute_score("#### 8", "8", score=2.0) == 2.0


def test_ground_truth_may_be_an_int_or_have_commas():
    assert compute_score("#### 1200", 1200) == 1.0
    assert compute_score("#### 1200", "1,200") == 1.0
    assert compute_score("#### -3", "-3") == 1.0


def test_only_the_tail_of_a_long_response_is_searched():
    text = "#### 5 " + "x" * 1000
    assert compute_score(text, "5") == 0.0  # the marker is outside the searched tail


def test_unknown_method_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="strict"):
        extract_solution("#### 1", method="loose")
