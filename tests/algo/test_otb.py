"""Optimal Token Baseline against a float64 reference written from its formula (arXiv:2602.07078, verl's
optimal_token_baseline / tir_optimal_token_baseline), token by token in plain Python."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from lathe.algo.otb import optimal_token_baseline, tir_optimal_token_baseline, variance_proxy_metrics


def _batch(rng, sizes=(3, 4, 1, 2), width=7, holes=False):
    index = np.array([f"p{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    b = len(index)
    lengths = rng.integers(1, width + 1, size=b)
    lengths[0] = width
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:                                     # multi-turn: tool answers inside the response are not model tokens
        mask[:, 2] = 0.0
        mask[1, 4:6] = 0.0
    rewards = rng.normal(size=(b, width)) * mask
    logits = rng.normal(size=(b, width, 5))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = rng.integers(0, 5, size=(b, width))
    old_lp = np.log(np.take_along_axis(probs, chosen[..., None], -1)[..., 0])
    sum_sq = (probs ** 2).sum(-1)
    rho = rng.uniform(0.5, 1.5, size=(b, width))
    return index, mask, rewards, old_lp, sum_sq, rho


def _reference(index, mask, rewards, old_lp, sum_sq, rho, compact, zero_tail=True, eps=1e-8):
    b, width = mask.shape
    # per row: the list of its token positions the baseline compares (all positions, or the valid ones in order)
    pos = [[t for t in range(width) if mask[i, t]] if compact else list(range(width)) for i in range(b)]
    alive = [[bool(mask[i, t]) for t in pos[i]] for i in range(b)]
    G, W = np.zeros((b, width)), np.zeros((b, width))
    for i in range(b):
        for t in range(width):
            G[i, t] = sum(rewards[i, k] * mask[i, k] for k in range(t, width))
            W[i, t] = sum((1 - 2 * np.exp(old_lp[i, j]) + sum_sq[i, j]) * rho[i, j] ** 2 * mask[i, j]
                          for j in range(t + 1))
    groups = defaultdict(list)
    for i, key in enumerate(index):
        if not compact or mask[i].sum() > 0:
            groups[key].append(i)
    adv = np.zeros((b, width))
    for rows in groups.values():
        lengths = {i: int(sum(alive[i])) for i in rows}
        ordered = sorted(lengths.values())
        for i in rows:
            for k, t in enumerate(pos[i]):
                if not alive[i][k]:
                    continue
                if len(rows) == 1:
                    base = 0.0
                else:
                    num = den = 0.0
                    for j in rows:           # trajectory j's k-th compared token, when it has one
                        if k < len(pos[j]) and alive[j][k]:
                            num += G[j, pos[j][k]] * W[j, pos[j][k]]
                            den += W[j, pos[j][k]]
                    base = num / (den + eps)
                    longest = [j for j in rows if lengths[j] == ordered[-1]]
                    if zero_tail and longest == [i] and ordered[-1] > ordered[-2] and k >= ordered[-2]:
                        base = 0.0
                adv[i, t] = G[i, t] - base
    return adv, G * mask


@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_otb_matches_reference(rng, with_is, zero_tail):
    index, mask, rewards, old_lp, sum_sq, rho = _batch(rng)
    rho = rho if with_is else np.ones_like(rho)
    t = lambda x: torch.tensor(x)  # noqa: E731
    adv, ret = optimal_token_baseline(token_level_rewards=t(rewards), response_mask=t(mask), index=index,
                                      old_log_probs=t(old_lp), sum_pi_squared=t(sum_sq),
                                      rollout_is_weights=t(rho) if with_is else None, handle_zero_tail=zero_tail)
    ref_adv, ref_ret = _reference(index, mask, rewards, old_lp, sum_sq, rho, compact=False, zero_tail=zero_tail)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ret.numpy() * mask, ref_ret, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("holes", [False, True])
def test_tir_otb_matches_reference(rng, holes):
    index, mask, rewards, old_lp, sum_sq, rho = _batch(rng, holes=holes)
    mask[5] = 0.0                                  # an empty row leaves its group
    rewards = rewards * mask
    t = lambda x: torch.tensor(x)  # noqa: E731
    adv, _ = tir_optimal_token_baseline(token_level_rewards=t(rewards), response_mask=t(mask), index=index,
                                        old_log_probs=t(old_lp), sum_pi_squared=t(sum_sq), rollout_is_weights=t(rho))
    ref_adv, _ = _reference(index, mask, rewards, old_lp, sum_sq, rho, compact=True)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-9, atol=1e-12)


def test_tir_equals_otb_without_holes(rng):
    index, mask, rewards, old_lp, sum_sq, _ = _batch(rng)
    kw = dict(token_level_rewards=torch.tensor(rewards), response_mask=torch.tensor(mask), index=index,
              old_log_probs=torch.tensor(old_lp), sum_pi_squared=torch.tensor(sum_sq))
    torch.testing.assert_close(tir_optimal_token_baseline(**kw)[0], optimal_token_baseline(**kw)[0])


def test_otb_without_sum_pi_squared_names_the_key(rng):
    index, mask, rewards, old_lp, _, _ = _batch(rng)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        optimal_token_baseline(token_level_rewards=torch.tensor(rewards), response_mask=torch.tensor(mask),
                               index=index, old_log_probs=torch.tensor(old_lp))


@pytest.mark.parametrize("with_is", [False, True])
def test_variance_proxy_metrics_match_reference(rng, with_is):
    index, mask, _, old_lp, sum_sq, rho = _batch(rng)
    rho[0, 1] = 0.0                                   # a token IcePop dropped
    adv = rng.normal(size=mask.shape) * mask
    t = lambda x: torch.tensor(x)  # noqa: E731
    out = variance_proxy_metrics(t(adv), t(mask), t(old_lp), t(sum_sq), t(rho) if with_is else None, grad_norm=0.3)
    a, W, W0, r = [], [], [], []
    for i in range(mask.shape[0]):
        valid = [k for k in range(mask.shape[1]) if mask[i, k]]
        w = {k: 1 - 2 * np.exp(old_lp[i, k]) + sum_sq[i, k] for k in valid}
        a.append(sum(adv[i, k] for k in valid) / len(valid))
        W.append(sum(w[k] * (rho[i, k] ** 2 if with_is else 1.0) for k in valid))
        W0.append(sum(w[k] for k in valid if not with_is or rho[i, k] != 0))
        r.append(sum(rho[i, k] for k in valid) / len(valid) if with_is else 1.0)
    a, W, W0, r = map(np.array, (a, W, W0, r))
    power = np.mean(r ** 2 * a ** 2 * np.maximum(W0, 0))
    assert out["variance_proxy/proxy1_signal_strength"] == pytest.approx(0.09)
    assert out["variance_proxy/proxy2_total_power"] == pytest.approx(power, rel=1e-12)
    assert out["variance_proxy/proxy3_pure_noise"] == pytest.approx(max(0.0, (power - 0.09) / (len(a) - 1)))
    assert out["variance_proxy/expected_a_squared"] == pytest.approx(np.mean(a ** 2), rel=1e-12)
    assert out["variance_proxy/expected_w"] == pytest.approx(np.mean(W), rel=1e-12)
