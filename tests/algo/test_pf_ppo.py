"""PF-PPO's weights and resampling (lathe.algo.pf_ppo) against a plain-Python reading of the formulas."""

import math
from collections import Counter

import pytest
import torch

from lathe.algo.pf_ppo import REWEIGHT_METHODS, pf_ppo_resample, pf_ppo_weights


def reference_weights(scores: list[float], method: str, power: float) -> list[float]:
    """The module docstring's formulas, one row at a time."""
    top, bottom = max(scores), min(scores)
    out = []
    for s in scores:
        if method == "pow":
            w = abs(s) ** power
        elif method == "max_min":
            w = 1.0 if s in (top, bottom) else 0.0
        else:
            w = 0.4 if s == top else 0.1
        out.append(max(w + 1e-8, 1e-8))
    return out


SCORES = [
    [1.0, 0.0, 0.5, 1.0, -1.0, 0.25],
    [-2.0, -0.5, -3.0, -0.5],                  # negative scores: pow weighs their magnitude
    [0.3, 0.3, 0.3],                           # all equal
    [0.0, 0.0, 0.0, 0.0],                      # all zero: zero total weight before the floor
    [7.0],
]


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("method", REWEIGHT_METHODS)
@pytest.mark.parametrize("power", [2.0, 1.0, 0.5, 0.0])
def test_weights_follow_the_formulas(scores, method, power):
    got = pf_ppo_weights(torch.tensor(scores, dtype=torch.float32), method, power)
    assert got.dtype == torch.float64 and got.shape == (len(scores),)
    want = reference_weights([float(torch.tensor(s, dtype=torch.float32)) for s in scores], method, power)
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=0)


def test_edge_cases_draw_uniformly_or_by_magnitude():
    zero = pf_ppo_weights(torch.zeros(4), "pow", 2.0)
    assert torch.equal(zero, torch.full((4,), 1e-8, dtype=torch.float64))        # the floor alone: uniform
    assert pf_ppo_weights(torch.full((3,), 0.3), "max_min").tolist() == [1 + 1e-8] * 3
    assert pf_ppo_weights(torch.full((3,), 0.3), "max_random").tolist() == [0.4 + 1e-8] * 3
    neg = pf_ppo_weights(torch.tensor([-2.0, 2.0, -1.0]), "pow", 2.0)
    assert neg[0] == neg[1] == 4 + 1e-8 and neg[2] == 1 + 1e-8
    assert pf_ppo_weights(torch.zeros(0), "pow").numel() == 0


def test_bad_method_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"algorithm.pf_ppo.reweight_method='power'.*pow, max_min, max_random"):
        pf_ppo_weights(torch.ones(2), "power")


@pytest.mark.parametrize(("scores", "power", "words"), [
    ([1.0, float("nan")], 2.0, "NaN or infinite"),
    ([1.0, float("inf")], 2.0, "NaN or infinite"),
    ([1.0, 0.0], -1.0, "weight_pow=-1.0 is not finite"),
])
def test_weights_that_cannot_be_drawn_from_fail_clearly(scores, power, words):
    with pytest.raises(ValueError, match=words):
        pf_ppo_weights(torch.tensor(scores), "pow", power)


def test_resample_keeps_the_size_draws_with_replacement_sorted_and_is_seeded():
    scores = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    a = pf_ppo_resample(scores, "max_random", generator=torch.Generator().manual_seed(3))
    b = pf_ppo_resample(scores, "max_random", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (8,)
    assert torch.equal(a, a.sort().values) and a.min() >= 0 and a.max() < 8
    # the same multiset as torch.multinomial's draw from the same generator state
    drawn = torch.multinomial(pf_ppo_weights(scores, "max_random"), 8, replacement=True,
                              generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, drawn.sort().values)
    assert pf_ppo_resample(torch.zeros(0)).numel() == 0


def test_resample_frequencies_match_the_weights():
    """Over many draws each row comes up in proportion to its weight (binomial 5-sigma bounds)."""
    scores = torch.tensor([2.0, -1.0, 0.0, 0.5, 1.0])
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    rounds = 4000
    for _ in range(rounds):
        counts.update(pf_ppo_resample(scores, "pow", 2.0, generator=gen).tolist())
    total = rounds * len(scores)
    weights = reference_weights(scores.tolist(), "pow", 2.0)
    for i, w in enumerate(weights):
        p = w / sum(weights)
        assert abs(counts[i] - total * p) <= 5 * math.sqrt(total * p * (1 - p)) + 1, (i, counts[i], total * p)
    assert counts[2] <= 1                                       # a zero score under pow: weight 1e-8 of 5.25


def test_max_min_keeps_only_the_extremes():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2, 0.4])
    idx = pf_ppo_resample(scores, "max_min", generator=torch.Generator().manual_seed(1))
    assert set(idx.tolist()) <= {0, 1, 3}
