import re

import pytest

from lathe.reward.math import compute_score, is_equiv, last_boxed_only_string


def _perturb(answer: str) -> str:
    """Change the first digit (or append '+1' when there is none): a different answer."""
    m = re.search(r"\d", answer)
    if m is None:
        return answer + "+1"
    return answer[: m.start()] + str((int(m.group()) + 1) % 10) + answer[m.end() :]


def test_math500_boxed_answer_scores_one_and_a_perturbed_answer_zero(load_jsonl):
    rows = load_jsonl("math500/test.jsonl")
    assert len(rows) == 500
    misses = [r["answer"] for r in rows if compute_score(f"So we get $\\boxed{{{r['answer']}}}$.", r["answer"]) != 1.0]
    assert misses == []
    false_hits = [r["answer"] for r in rows if compute_score(f"\\boxed{{{_perturb(r['answer'])}}}", r["answer"]) != 0.0]
    assert false_hits == []


def test_math500_reference_solutions_score_one(load_jsonl):
    rows = load_jsonl("math500/test.jsonl")
    misses = [r["unique_id"] for r in rows if compute_score(r["solution"], r["answer"]) != 1.0]
    assert misses == []                # the solution's last box is the answer, often written its own way


@pytest.mark.parametrize("name,rows_wanted", [("aime24", 30), ("amc23", 40)])
def test_competition_answers_score_one_and_the_next_number_zero(load_jsonl, name, rows_wanted):
    """AIME/AMC answers are numbers: the boxed answer (and AIME's reference solution) scores 1; one more, 0."""
    rows = load_jsonl(f"{name}/test.jsonl")
    assert len(rows) == rows_wanted
    for r in rows:
        truth = f"{float(r['answer']):g}"
        assert compute_score(f"Thus the answer is $\\boxed{{{truth}}}$.", truth) == 1.0, r["id"]
        assert compute_score(f"\\boxed{{{float(r['answer']) + 1:g}}}", truth) == 0.0, r["id"]
        if "\\boxed" in r.get("solution", ""):
            assert compute_score(r["solution"], truth) == 1.0, r["id"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\fbox{7}", "7"),
        ("answer: \\boxed 5$ done", "5"),
        ("no box here", None),
        ("\\boxed{unclosed {", None),
    ],
)
def test_last_boxed_only_string(text, expected):
    assert last_boxed_only_string(text) == expected


@pytest.mark.parametrize(
    "pred, truth",
    [
        ("\\dfrac{1}{2}", "\\frac12"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\left(3, \\frac{\\pi}{2}\\right)", "(3,\\frac{\\pi}{2})"),
        ("10\\text{ cm}^2", "10"),
        ("5.0", "5"),
        ("x = 5", "5"),
        ("1,000", "1000"),
        ("90^\\circ", "90"),
        ("\\$18.50", "18.5"),
        ("\\text{Evelyn}", "Evelyn"),
        ("2\\!\\sqrt3", "2\\sqrt{3}"),
        ("-\\frac{3}{4}", "-0.75"),
        # symbolic equality, which string normalisation cannot see (math-verify parses both into sympy)
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("(x+1)^2", "x^2+2x+1"),
        ("\\{2, 1\\}", "\\{1,2\\}"),
        ("[0, 1)", "[0,1)"),
    ],
)
def test_equivalent_forms_match(pred, truth):
    assert is_equiv(pred, truth)


@pytest.mark.parametrize(
    "pred, truth",
    [("0.333", "\\frac{1}{3}"), ("1,2", "12"), ("\\sqrt{8}", "3\\sqrt{2}"), ("x^2", "x^3"), ("-5", "5"),
     ("[0, 1]", "[0,1)"), ("(1,2)", "(2,1)")],
)
def test_different_answers_do_not_match(pred, truth):
    assert not is_equiv(pred, truth)


def test_no_box_scores_zero_and_a_boxed_ground_truth_is_unboxed():
    assert compute_score("the answer is 5", "5") == 0.0
    assert compute_score("\\boxed{5}", "\\boxed{5}") == 1.0
    assert compute_score("\\boxed{}", "5") == 0.0 and compute_score("\\boxed{\\frac{1}{}}", "1") == 0.0
