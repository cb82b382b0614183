import numpy as np
import pytest
import torch

from lathe.algo.policy_loss import PolicyLossParams
from lathe.algo.policy_loss_cov import clip_cov, kl_cov

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def _inputs(randn, ragged_mask):
    old = randn(6, 8) - 1.0
    lp = (old + randn(6, 8, scale=0.3)).requires_grad_(True)
    adv = randn(6, 8, scale=3.0)
    return old, lp, adv, ragged_mask(6, 8)


def _cov(adv, lp, m):
    v = m > 0
    return (adv - adv[v].mean()) * (lp - lp[v].mean())


@pytest.mark.parametrize("ratio", [0.05, 0.3])
def test_kl_cov_penalises_the_top_covariance_tokens(randn, ragged_mask, ratio):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    params = PolicyLossParams(kl_cov_ratio=ratio, ppo_kl_coef=0.7)
    loss, metrics = kl_cov(old, lp, adv, mask, params=params)
    o, lpn, a, m = (t.detach().numpy() for t in (old, lp, adv, mask))
    cov = _cov(a, lpn, m)
    valid = list(zip(*np.nonzero(m > 0), strict=True))
    k = max(1, int(len(valid) * ratio))
    top = sorted(valid, key=lambda ij: -cov[ij])[:k]
    per_token = -a * np.exp(lpn - o)
    for ij in top:
        per_token[ij] += 0.7 * abs(lpn[ij] - o[ij])
    assert float(loss) == pytest.approx((per_token * m).sum() / m.sum(), rel=1e-12)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx((np.abs(lpn - o) * m).sum() / m.sum(), rel=1e-12)


def test_clip_cov_cuts_every_candidate_when_the_budget_allows(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=0.2, clip_cov_ub=3.0)
    loss, metrics = clip_cov(old, lp, adv, mask, params=params)
    o, lpn, a, m = (t.detach().numpy() for t in (old, lp, adv, mask))
    r = np.exp(lpn - o)
    l1, l2 = -a * r, -a * np.clip(r, 0.8, 1.2)
    cov = _cov(a, lpn, m)
    cut = (m > 0) & ~(l2 > l1) & (cov > 0.2) & (cov < 3.0)
    assert cut.sum() > 0
    expected = (np.maximum(l1, l2) * ~cut * m).sum() / m.sum()
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(cut.sum() / m.sum())


def test_clip_cov_cut_count_follows_the_ratio(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    torch.manual_seed(0)
    params = PolicyLossParams(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=100.0)
    loss, metrics = clip_cov(old, lp, adv, mask, params=params)
    n_valid = int(mask.sum())
    assert round(float(metrics["actor/pg_clipfrac"]) * n_valid) == max(1, int(0.05 * n_valid))
    loss.backward()
    o, lpn, a, m = (t.detach().numpy() for t in (old, lp, adv, mask))
    r = np.exp(lpn - o)
    ppo_clipped = int(((-a * np.clip(r, 0.8, 1.2) > -a * r) & (m > 0)).sum())  # flat by PPO already
    assert int((lp.grad[mask > 0] == 0).sum()) == ppo_clipped + max(1, int(0.05 * n_valid))
