"""GDPO against a float64 reference written from its formula (arXiv:2601.05242, verl's gdpo estimator)."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from lathe.algo.gdpo import gdpo
from lathe.algo.registry import get_adv_estimator

EPS = 1e-6


def _reference(comps, weights, index, mask, norm):
    """Per component: group (x - mean) / (std_unbiased + eps) (lone sample: mean 0, std 1); weighted sum; then
    whitening over every valid token of the batch: (v - mean) / sqrt(var_unbiased + 1e-8)."""
    groups = defaultdict(list)
    for i, key in enumerate(index):
        groups[key].append(i)
    total = np.zeros(comps.shape[0])
    for k in range(comps.shape[1]):
        normed = np.zeros(comps.shape[0])
        for rows in groups.values():
            x = comps[rows, k]
            mean, std = (0.0, 1.0) if len(rows) == 1 else (x.mean(), x.std(ddof=1))
            normed[rows] = (x - mean) / (std + EPS) if norm else x - mean
        total += weights[k] * normed
    tokens = np.repeat(total, mask.sum(axis=1).astype(int))        # one value per valid token
    whitened = (total - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    return whitened[:, None] * mask


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.3, 2.0]])
def test_gdpo_matches_reference(outcome_batch, rng, norm, weights):
    b = outcome_batch
    comps = np.stack([b["scores"], rng.integers(0, 2, size=len(b["scores"])).astype(np.float64),
                      10.0 * rng.normal(size=len(b["scores"]))], axis=1)
    adv, ret = gdpo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"],
                    reward_components=torch.tensor(comps), reward_weights=weights, norm_adv_by_std_in_grpo=norm)
    ref = _reference(comps, weights or [1.0, 1.0, 1.0], b["index"], b["mask"].numpy(), norm)
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-9, atol=1e-12)
    assert torch.equal(adv, ret)
    assert get_adv_estimator("gdpo") is gdpo


def test_gdpo_one_component_is_whitened_grpo(outcome_batch):
    b = outcome_batch
    adv, _ = gdpo(response_mask=b["mask"], index=b["index"], reward_components=torch.tensor(b["scores"])[:, None])
    ref = _reference(b["scores"][:, None], [1.0], b["index"], b["mask"].numpy(), True)
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-9, atol=1e-12)


def test_gdpo_balances_components_of_different_scales():
    # two prompts x 2 samples; component 0 varies by 100, component 1 by 1: after per-component normalisation
    # both contribute equally, so sample 1 of prompt 0 (better on both) and the tie in prompt 1 come out as below
    comps = torch.tensor([[0.0, 0.0], [100.0, 1.0], [100.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.float64)
    adv, _ = gdpo(response_mask=mask, index=["a", "a", "b", "b"], reward_components=comps)
    row = adv[:, 0]
    assert row[1] > 0 > row[0] and abs(float(row[2])) < 1e-5 and abs(float(row[3])) < 1e-5  # eps


def test_gdpo_errors_name_what_is_missing(outcome_batch):
    b = outcome_batch
    with pytest.raises(ValueError, match="reward_components"):
        gdpo(response_mask=b["mask"], index=b["index"])
    comps = torch.zeros(len(b["scores"]), 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="gdpo_reward_weights has 3 weights for 2"):
        gdpo(response_mask=b["mask"], index=b["index"], reward_components=comps, reward_weights=[1, 2, 3])
