"""Each estimator against an independent float64 reference written from its paper's formula."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from lathe.algo.advantages import (
    gae,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from lathe.algo.registry import get_adv_estimator

EPS = 1e-6


def _groups(index):
    groups = defaultdict(list)
    for i, key in enumerate(index):
        groups[key].append(i)
    return groups


def _whiten(values, mask):
    v = values[mask > 0]
    return (values - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)


def _check_outcome(adv, per_row, mask):
    """adv (B,T) must be per_row broadcast on valid tokens and 0 on padding."""
    expected = np.asarray(per_row)[:, None] * mask.numpy()
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(outcome_batch, norm):
    b = outcome_batch
    ref = np.zeros(len(b["scores"]))
    for rows in _groups(b["index"]).values():
        s = b["scores"][rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (s.mean(), s.std(ddof=1))
        ref[rows] = (s - mean) / (std + EPS) if norm else s - mean
    adv, ret = grpo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"],
                    norm_adv_by_std_in_grpo=norm)
    _check_outcome(adv, ref, b["mask"])
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_scores_sum_to_zero_within_groups(outcome_batch, norm):
    b = outcome_batch
    adv, _ = grpo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"],
                  norm_adv_by_std_in_grpo=norm)
    per_seq = adv[:, 0].numpy()  # every row has at least one valid token at position 0
    for rows in _groups(b["index"]).values():
        if len(rows) > 1:
            assert abs(per_seq[rows].sum()) < 1e-9


def test_grpo_singleton_group_uses_mean0_std1(outcome_batch):
    b = outcome_batch
    alone = [i for i, k in enumerate(b["index"]) if list(b["index"]).count(k) == 1][0]
    adv, _ = grpo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"])
    assert float(adv[alone, 0]) == pytest.approx(b["scores"][alone] / (1 + EPS), rel=1e-12)


def test_rloo_equals_leave_one_out_definition(outcome_batch):
    b = outcome_batch
    ref = np.zeros(len(b["scores"]))
    for rows in _groups(b["index"]).values():
        for i in rows:
            others = [b["scores"][j] for j in rows if j != i]
            ref[i] = b["scores"][i] - (np.mean(others) if others else 0.0)
    adv, _ = rloo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=list(b["index"]))
    _check_outcome(adv, ref, b["mask"])


def test_opo_length_weighted_baseline(outcome_batch):
    b = outcome_batch
    lengths = b["mask"].sum(1).numpy()
    ref = np.zeros(len(b["scores"]))
    for rows in _groups(b["index"]).values():
        base = 0.0 if len(rows) == 1 else np.dot(lengths[rows], b["scores"][rows]) / lengths[rows].sum()
        ref[rows] = b["scores"][rows] - base
    adv, _ = opo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"])
    _check_outcome(adv, ref, b["mask"])


def test_gpg_alpha_scaled_group_centering(outcome_batch):
    b = outcome_batch
    scores = b["scores"].copy()
    scores[1] = 0.0  # make the non-zero count differ from the batch size
    rewards = b["rewards"].clone()
    rewards[1] = 0.0
    alpha = len(scores) / max(1, np.count_nonzero(scores))
    ref = np.zeros(len(scores))
    for rows in _groups(b["index"]).values():
        mean = 0.0 if len(rows) == 1 else scores[rows].mean()
        ref[rows] = alpha * (scores[rows] - mean)
    adv, _ = gpg(token_level_rewards=rewards, response_mask=b["mask"], index=b["index"])
    _check_outcome(adv, ref, b["mask"])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_only_best_sample_learns(outcome_batch, norm):
    b = outcome_batch
    index = np.array([k if k != "uid2" else "uid1" for k in b["index"]], dtype=object)  # no singleton
    ref = np.zeros(len(b["scores"]))
    for rows in _groups(index).values():
        s = b["scores"][rows]
        order = sorted(range(len(rows)), key=lambda j: -s[j])
        gap = s[order[0]] - s[order[1]]
        ref[rows[order[0]]] = gap / (s.std(ddof=1) + EPS) if norm else gap
    adv, _ = grpo_passk(token_level_rewards=b["rewards"], response_mask=b["mask"], index=index,
                        norm_adv_by_std_in_grpo=norm)
    _check_outcome(adv, ref, b["mask"])


def test_grpo_passk_rejects_singleton_groups(outcome_batch):
    b = outcome_batch
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        grpo_passk(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"])


def test_remax_return_to_go_minus_greedy_baseline(randn, ragged_mask):
    rewards, mask, base = randn(5, 6), ragged_mask(5, 6), randn(5)
    r, m = rewards.numpy(), mask.numpy()
    returns = np.array([[sum(r[i, k] * m[i, k] for k in range(t, 6)) for t in range(6)] for i in range(5)])
    adv, ret = remax(token_level_rewards=rewards, response_mask=mask, reward_baselines=base)
    np.testing.assert_allclose(ret.numpy(), returns, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), (returns - base.numpy()[:, None]) * m, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_discounted_returns_whitened(randn, ragged_mask, gamma):
    rewards, mask = randn(5, 6), ragged_mask(5, 6)
    r, m = rewards.numpy(), mask.numpy()
    returns = np.zeros_like(r)
    for i in range(5):
        n = int(m[i].sum())
        for t in range(n):
            returns[i, t] = sum(gamma ** (k - t) * r[i, k] for k in range(t, n))
    adv, ret = reinforce_plus_plus(token_level_rewards=rewards, response_mask=mask, gamma=gamma)
    np.testing.assert_allclose(ret.numpy(), returns, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), _whiten(returns, m) * m, rtol=1e-9, atol=1e-12)


def test_reinforce_plus_plus_baseline_centres_then_whitens(outcome_batch):
    b = outcome_batch
    m = b["mask"].numpy()
    centred = np.zeros(len(b["scores"]))
    for rows in _groups(b["index"]).values():
        centred[rows] = b["scores"][rows] - (0.0 if len(rows) == 1 else b["scores"][rows].mean())
    tiled = centred[:, None] * m
    adv, _ = reinforce_plus_plus_baseline(token_level_rewards=b["rewards"], response_mask=b["mask"],
                                          index=b["index"])
    np.testing.assert_allclose(adv.numpy(), _whiten(tiled, m) * m, rtol=1e-9, atol=1e-12)


def _gae_reference(r, v, m, gamma, lam):
    adv = np.zeros_like(r)
    for i in range(r.shape[0]):
        valid = [t for t in range(r.shape[1]) if m[i, t] > 0]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(valid):
            delta = r[i, t] + gamma * nxt_v - v[i, t]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = v[i, t]
            adv[i, t] = nxt_a
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_with_observation_holes(randn, ragged_mask, gamma, lam):
    rewards, values, mask = randn(5, 8), randn(5, 8), ragged_mask(5, 8, min_len=4)
    mask[0, 2] = 0.0  # a multi-turn observation token inside a response: skipped by GAE
    r, v, m = rewards.numpy(), values.numpy(), mask.numpy()
    raw = _gae_reference(r, v, m, gamma, lam)
    adv, ret = gae(token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(ret.numpy(), (raw + v) * m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), _whiten(raw, m) * m, rtol=1e-9, atol=1e-12)


def test_gae_gamma_lam_one_is_returns_minus_values(randn, ragged_mask):
    rewards, values, mask = randn(4, 6), randn(4, 6), ragged_mask(4, 6)
    adv, ret = gae(token_level_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=1.0)
    r, v, m = rewards.numpy(), values.numpy(), mask.numpy()
    mc_return = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)  # undiscounted reward-to-go
    np.testing.assert_allclose(ret.numpy(), mc_return * m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), _whiten((mc_return - v) * m, m) * m, rtol=1e-9, atol=1e-12)


def test_all_estimators_share_the_keyword_call(outcome_batch, randn):
    b = outcome_batch
    index = np.array([k if k != "uid2" else "uid1" for k in b["index"]], dtype=object)
    kwargs = dict(token_level_rewards=b["rewards"], response_mask=b["mask"], index=index,
                  values=randn(*b["mask"].shape), gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                  reward_baselines=randn(len(index)), epsilon=1e-6, unused_extra_key=3)
    for name in ["gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                 "remax", "opo", "gpg"]:
        adv, ret = get_adv_estimator(name)(**kwargs)
        assert adv.shape == ret.shape == b["mask"].shape
        assert torch.all(adv[b["mask"] == 0] == 0), name


def test_missing_inputs_name_the_estimator(outcome_batch):
    b = outcome_batch
    with pytest.raises(ValueError, match="'gae' needs `values`"):
        gae(token_level_rewards=b["rewards"], response_mask=b["mask"])
    with pytest.raises(ValueError, match="'remax' needs `reward_baselines`"):
        remax(token_level_rewards=b["rewards"], response_mask=b["mask"])
    with pytest.raises(ValueError, match="index"):
        grpo(token_level_rewards=b["rewards"], response_mask=b["mask"])
    with pytest.raises(ValueError, match="one group id per row"):
        rloo(token_level_rewards=b["rewards"], response_mask=b["mask"], index=b["index"][:-1])
