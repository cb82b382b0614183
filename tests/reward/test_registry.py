import pytest

from lathe.reward.registry import default_compute_score


@pytest.mark.parametrize(
    "data_source, good, bad, truth",
    [
        ("openai/gsm8k", "so #### 72", "so #### 71", "72"),
        ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{3}}", "\\frac12"),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "\\boxed{4}", "3"),
        ("HuggingFaceH4/MATH-500", "\\boxed{3}", "\\boxed{4}", "3"),
        ("aime24", "\\boxed{204}", "\\boxed{205}", "204"),
        ("lathe/arithmetic", " 17 ", "18", "17"),
    ],
)
def test_dispatch_by_data_source(data_source, good, bad, truth):
    assert default_compute_score(data_source, good, truth) == 1.0
    assert default_compute_score(data_source, bad, truth, extra_info={"index": 0}) == 0.0


def test_gsm8k_scorer_is_not_used_for_math():
    # a gsm8k-style answer is not a boxed answer: proves MATH does not fall back to gsm8k
    assert default_compute_score("lighteval/MATH", "#### 3", "3") == 0.0


def test_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(NotImplementedError, match=r"my/dataset.*reward\.custom_reward_function\.path="):
        default_compute_score("my/dataset", "x", "y")
