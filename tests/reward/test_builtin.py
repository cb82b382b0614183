from lathe.reward.builtin import compute_score


def test_exact_match_after_strip():
    assert compute_score(" 42\n", "42") == 1.0
    assert compute_score("42", 42) == 1.0


def test_anything_else_scores_zero():
    assert compute_score("43", "42") == 0.0
    assert compute_score("42.", "42") == 0.0
    assert compute_score("", "42") == 0.0
