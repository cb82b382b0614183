"""Policy/value losses against float64 per-token references; gradients checked against hand derivatives."""

import math

import numpy as np
import pytest
import torch

from lathe.algo.aggregate import global_batch_info
from lathe.algo.policy_loss import (
    PolicyLossParams,
    cispo,
    compute_entropy_loss,
    compute_value_loss,
    geo_mean,
    gpg,
    gspo,
    sapo,
    vanilla,
)
from lathe.algo.registry import POLICY_LOSSES

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def _inputs(randn, ragged_mask, batch=6, width=7, scale=0.3):
    old = randn(batch, width) - 1.0
    lp = (old + randn(batch, width, scale=scale)).requires_grad_(True)
    return old, lp, randn(batch, width), ragged_mask(batch, width)


def _np(*tensors):
    return [t.detach().numpy() for t in tensors]


def _vanilla_ref(old, lp, adv, mask, low, high, c):
    """Per-token PPO dual-clip loss, gradient d lpn / d lp and clip indicators, by explicit branches."""
    loss, grad = np.zeros_like(lp), np.zeros_like(lp)
    clip, lower = np.zeros_like(lp), np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        a, r = adv[idx], math.exp(lp[idx] - old[idx])
        unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
        value, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        clip[idx] = clipped > unclipped
        if a < 0 and value > -a * c:
            value, slope, lower[idx] = -a * c, 0.0, 1.0
        loss[idx], grad[idx] = value, slope
    return loss, grad, clip, lower


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28)])
def test_vanilla_value_gradient_and_metrics(randn, ragged_mask, low, high):
    old, lp, adv, mask = _inputs(randn, ragged_mask, scale=0.6)
    params = PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=1.5)
    loss, metrics = vanilla(old, lp, adv, mask, loss_agg_mode="token-mean", params=params)
    loss.backward()
    o, lpn, a, m = _np(old, lp, adv, mask)
    ref, grad, clip, lower = _vanilla_ref(o, lpn, a, m, low, high, 1.5)
    n = m.sum()
    assert float(loss) == pytest.approx((ref * m).sum() / n, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), grad * m / n, rtol=1e-10, atol=1e-15)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx((clip * m).sum() / n)
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx((lower * m).sum() / n)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(((o - lpn) * m).sum() / n, rel=1e-12)
    assert (clip * m).sum() > 0 and (lower * m).sum() > 0  # the branches were exercised


def test_clip_fraction_at_the_exact_boundaries():
    x = torch.tensor([[0.18, 0.19, -0.22, -0.25]], dtype=torch.float64)
    ratio = torch.exp(x)
    high, low = float(ratio[0, 0]) - 1.0, 1.0 - float(ratio[0, 2])  # tokens 0 and 2 sit exactly on 1 +- eps
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    params = PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high)
    _, metrics = vanilla(torch.zeros_like(x), x, adv, torch.ones_like(x), params=params)
    assert float(metrics["actor/pg_clipfrac"]) == 0.5  # only the strictly-outside tokens 1 and 3


def test_dual_clip_boundary_and_flat_gradient():
    x = torch.tensor([[1.2, 1.5, 0.3]], dtype=torch.float64, requires_grad=True)
    c = float(torch.exp(torch.tensor(1.2, dtype=torch.float64)))  # token 0's ratio equals clip_ratio_c
    adv = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    params = PolicyLossParams(clip_ratio=0.2, clip_ratio_c=c)
    loss, metrics = vanilla(torch.zeros(1, 3, dtype=torch.float64), x, adv, torch.ones(1, 3), params=params)
    loss.backward()
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx(1 / 3)  # only token 1 (ratio > c)
    assert float(x.grad[0, 1]) == 0.0  # the dual-clipped token is flat
    assert float(loss) == pytest.approx((c + c + math.exp(0.3)) / 3, rel=1e-12)


def test_is_weights_scale_per_token_losses(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    weights = torch.rand(mask.shape, dtype=torch.float64) * 2
    plain, _ = vanilla(old, lp, adv * weights, mask)  # w >= 0 commutes with both clips
    weighted, _ = vanilla(old, lp, adv, mask, rollout_is_weights=weights)
    assert float(weighted) == pytest.approx(float(plain), rel=1e-10)
    o, lpn, a, m = _np(old, lp, adv, mask)
    ref, _, _, _ = _vanilla_ref(o, lpn, a, m, 0.2, 0.2, 3.0)
    assert float(weighted) == pytest.approx((ref * weights.numpy() * m).sum() / m.sum(), rel=1e-12)


def test_gspo_sequence_ratio_value_and_gradient(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask, scale=0.15)
    params = PolicyLossParams(clip_ratio_low=0.02, clip_ratio_high=0.03)
    loss, metrics = gspo(old, lp, adv, mask, params=params)
    loss.backward()
    o, lpn, a, m = _np(old, lp, adv, mask)
    total, grad, clipped, rows = 0.0, np.zeros_like(lpn), 0, 0
    for i in range(len(lpn)):
        v = m[i] > 0
        s = math.exp((lpn[i][v] - o[i][v]).mean())
        unclipped, clip = -a[i][v] * s, -a[i][v] * min(max(s, 0.98), 1.03)
        total += np.maximum(unclipped, clip).mean()
        grad[i][v] = np.where(unclipped >= clip, -a[i][v] * s, 0.0) / v.sum()
        clipped += (clip > unclipped).sum()
        rows += 1
    assert float(loss) == pytest.approx(total / rows, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), grad / rows, rtol=1e-10, atol=1e-15)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(clipped / m.sum())


def test_cispo_stop_gradient_on_clipped_ratio(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask, scale=0.5)
    loss, metrics = cispo(old, lp, adv, mask, params=PolicyLossParams(clip_ratio_low=0.3, clip_ratio_high=0.1))
    loss.backward()
    o, lpn, a, m = _np(old, lp, adv, mask)
    r = np.exp(lpn - o)
    w = np.clip(r, 0.7, 1.1)
    n = m.sum()
    assert float(loss) == pytest.approx((-w * a * lpn * m).sum() / n, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), -w * a * m / n, rtol=1e-10, atol=1e-15)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(((w != r) * m).sum() / n)


def test_sapo_soft_gate_value_and_gradient(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask, scale=0.5)
    loss, _ = sapo(old, lp, adv, mask, params=PolicyLossParams(tau_pos=1.0, tau_neg=1.05))
    loss.backward()
    o, lpn, a, m = _np(old, lp, adv, mask)
    r = np.exp(lpn - o)
    tau = np.where(a > 0, 1.0, 1.05)
    sig = 1 / (1 + np.exp(-tau * (r - 1)))
    n_i, rows = m.sum(1, keepdims=True), len(m)
    assert float(loss) == pytest.approx(((-sig * 4 / tau * a * m) / n_i).sum() / rows, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), -a * 4 * sig * (1 - sig) * r * m / n_i / rows, rtol=1e-9)


def test_geo_mean_gmpo_reference(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask, scale=0.5)
    loss, metrics = geo_mean(old, lp, adv, mask, params=PolicyLossParams(clip_ratio=0.4))
    o, lpn, a, m = _np(old, lp, adv, mask)
    seq_losses, hi = [], 0
    for i in range(len(lpn)):
        v = m[i] > 0
        d, sgn = lpn[i][v] - o[i][v], np.sign(a[i][v])
        dc = np.clip(d, -0.4, 0.4)
        tilde = sgn * np.minimum(sgn * d, sgn * dc)
        seq_losses.append(-a[i][v].mean() * math.exp(tilde.mean()))
        hi += ((d != dc) & (a[i][v] > 0)).sum()
    assert float(loss) == pytest.approx(np.mean(seq_losses), rel=1e-12)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(hi / m.sum())


def test_gpg_is_plain_reinforce(randn, ragged_mask):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    loss, _ = gpg(old, lp, adv, mask, loss_agg_mode="seq-mean-token-sum")
    o, lpn, a, m = _np(old, lp, adv, mask)
    assert float(loss) == pytest.approx((-a * lpn * m).sum(1).mean(), rel=1e-12)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_no_gradient_reaches_masked_tokens(randn, ragged_mask, name):
    old, lp, adv, mask = _inputs(randn, ragged_mask)
    mask[1, 0] = 0.0
    with torch.no_grad():
        lp[mask == 0] = 40.0  # garbage far outside any trust region
    old = torch.where(mask > 0, old, torch.full_like(old, -40.0))
    params = PolicyLossParams(clip_cov_ratio=0.5, kl_cov_ratio=0.5, dro_beta=0.1)
    loss, metrics = POLICY_LOSSES[name](old, lp, adv, mask, params=params)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(torch.isfinite(lp.grad))
    assert torch.all(lp.grad[mask == 0] == 0)
    assert torch.any(lp.grad[mask > 0] != 0)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)


@pytest.mark.parametrize("name,mode", [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"),
                                       ("gspo", "token-mean"), ("geo_mean", "token-mean"), ("cispo", "token-mean")])
def test_loss_gradient_is_independent_of_the_micro_batch_split(randn, ragged_mask, name, mode):
    old, lp, adv, mask = _inputs(randn, ragged_mask, batch=8, width=6)
    fn = POLICY_LOSSES[name]
    fn(old, lp, adv, mask, loss_agg_mode=mode)[0].backward()
    whole = lp.grad.clone()
    lp.grad = None
    info = global_batch_info(mask)
    for part in (slice(0, 3), slice(3, 4), slice(4, 8)):
        fn(old[part], lp[part], adv[part], mask[part], loss_agg_mode=mode, agg_kwargs=info)[0].backward()
    np.testing.assert_allclose(lp.grad.numpy(), whole.numpy(), rtol=1e-10, atol=1e-15)


def test_value_loss_clipped_reference(randn, ragged_mask):
    vpreds, returns, values, mask = randn(5, 6), randn(5, 6), randn(5, 6), ragged_mask(5, 6)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    vp, rt, vl, m = _np(vpreds, returns, values, mask)
    e1, e2 = (vp - rt) ** 2, (np.clip(vp, vl - 0.5, vl + 0.5) - rt) ** 2
    assert float(loss) == pytest.approx(0.5 * (np.maximum(e1, e2) * m).sum() / m.sum(), rel=1e-12)
    assert float(clipfrac) == pytest.approx(((e2 > e1) * m).sum() / m.sum())
    unclipped, frac0 = compute_value_loss(vpreds, returns, values, mask, cliprange_value=None)
    assert float(unclipped) == pytest.approx(0.5 * (e1 * m).sum() / m.sum(), rel=1e-12) and float(frac0) == 0


def test_entropy_loss_aggregates(randn, ragged_mask):
    ent, mask = randn(3, 4).abs(), ragged_mask(3, 4)
    e, m = _np(ent, mask)
    assert float(compute_entropy_loss(ent, mask)) == pytest.approx((e * m).sum() / m.sum(), rel=1e-12)


def test_params_validation_and_fallbacks():
    p = PolicyLossParams(clip_ratio=0.3, clip_ratio_high=0.28)
    assert (p.low, p.high) == (0.3, 0.28)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossParams(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="tau_neg"):
        PolicyLossParams(tau_neg=0.0)
