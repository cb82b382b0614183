"""DPPO-Binary-TV/KL and DRO against float64 per-token references written from their formulas; gradients by hand."""

import math

import numpy as np
import pytest
import torch

from lathe.algo.policy_loss import PolicyLossParams
from lathe.algo.policy_loss_dppo import dppo_kl, dppo_tv, dro
from lathe.algo.registry import POLICY_LOSSES

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def _inputs(randn, ragged_mask, batch=8, width=9, scale=0.8):
    old = torch.clamp(randn(batch, width, scale=0.7) - 0.8, max=-1e-3)
    lp = torch.clamp(old + randn(batch, width, scale=scale), max=-1e-3).detach().requires_grad_(True)
    return old, lp, randn(batch, width), ragged_mask(batch, width)


def _keep(kind, a, p, q, low, high):
    """Whether the token still learns: its move p - q (TV) or binary KL stays inside the threshold on the side the
    advantage pushes."""
    if kind == "tv":
        return p - q <= high if a > 0 else p - q >= -low
    kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)


@pytest.mark.parametrize("kind,fn", [("tv", dppo_tv), ("kl", dppo_kl)])
@pytest.mark.parametrize("low,high,c", [(0.15, 0.15, 3.0), (0.05, 0.1, 1.5)])
def test_dppo_value_gradient_and_metrics(randn, ragged_mask, kind, fn, low, high, c):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    params = PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    loss, metrics = fn(old, lp, adv, mask, loss_agg_mode="token-mean", params=params)
    loss.backward()
    o, lpn, a, m = (t.detach().numpy() for t in (old, lp, adv, mask))
    value, grad, masked, truncated = (np.zeros_like(lpn) for _ in range(4))
    for idx in np.ndindex(lpn.shape):
        p, q = math.exp(lpn[idx]), math.exp(o[idx])
        ratio = p / q
        keep = _keep(kind, a[idx], p, q, low, high)
        weight = min(ratio, c) * keep                   # l = -A sg[min(r, c) keep] log p
        value[idx], grad[idx] = -a[idx] * weight * lpn[idx], -a[idx] * weight
        masked[idx], truncated[idx] = not keep, keep and ratio > c
    n = m.sum()
    assert float(loss) == pytest.approx((value * m).sum() / n, rel=1e-10)
    np.testing.assert_allclose(lp.grad.numpy(), grad * m / n, rtol=1e-9, atol=1e-15)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx((masked * m).sum() / n)
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx((truncated * m).sum() / n)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(((o - lpn) * m).sum() / n, rel=1e-10)
    assert 0 < (masked * m).sum() < n                   # both branches exercised
    assert POLICY_LOSSES[f"dppo_{kind}"] is fn


def test_dppo_kl_lets_a_token_move_against_its_advantage_freely():
    # A > 0 and the token's probability fell a lot: its binary KL is large, but the move is not the one the advantage
    # pushes, so it keeps learning (and the TV rule, p - q <= delta, keeps it too)
    old = torch.log(torch.tensor([[0.9]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.1]], dtype=torch.float64))
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    for fn in (dppo_kl, dppo_tv):
        _, metrics = fn(old, lp, adv, mask, params=PolicyLossParams(clip_ratio=0.01))
        assert float(metrics["actor/pg_clipfrac"]) == 0.0
        _, metrics = fn(old, lp, -adv, mask, params=PolicyLossParams(clip_ratio=0.01))
        assert float(metrics["actor/pg_clipfrac"]) == 1.0


@pytest.mark.parametrize("beta", [0.05, 1.0])
def test_dro_value_and_gradient(randn, ragged_mask, beta):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    loss, metrics = dro(old, lp, adv, mask, loss_agg_mode="token-mean", params=PolicyLossParams(dro_beta=beta))
    loss.backward()
    o, lpn, a, m = (t.detach().numpy() for t in (old, lp, adv, mask))
    value = -(lpn * a - 0.5 * beta * (lpn - o) ** 2)     # l = -(A log p - beta/2 (log p - log q)^2)
    grad = -(a - beta * (lpn - o))
    n = m.sum()
    assert float(loss) == pytest.approx((value * m).sum() / n, rel=1e-10)
    np.testing.assert_allclose(lp.grad.numpy(), grad * m / n, rtol=1e-9, atol=1e-15)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(((o - lpn) * m).sum() / n, rel=1e-10)
    assert float(metrics["actor/pg_clipfrac"]) == 0.0


@pytest.mark.parametrize("beta", [None, 0.0, -1.0])
def test_dro_needs_a_positive_beta(randn, ragged_mask, beta):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    with pytest.raises(ValueError, match="policy_loss.dro_beta"):
        dro(old, lp, adv, mask, params=PolicyLossParams(dro_beta=beta))
