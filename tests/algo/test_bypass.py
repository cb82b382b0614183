import numpy as np
import pytest
import torch

from lathe.algo.bypass import bypass_mode
from lathe.algo.policy_loss import PolicyLossParams

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def _inputs(randn, ragged_mask):
    rollout = randn(6, 8) - 1.0
    lp = (rollout + randn(6, 8, scale=0.25)).requires_grad_(True)
    return rollout, lp, randn(6, 8), ragged_mask(6, 8, min_len=2)


def test_ppo_clip_bypass_is_ppo_against_rollout_with_rejection(randn, ragged_mask):
    rollout, lp, adv, mask = _inputs(randn, ragged_mask)
    cfg = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25", "loss_type": "ppo_clip"}
    loss, metrics = bypass_mode(rollout, lp, adv, mask, params=PolicyLossParams(rollout_correction=cfg))
    loss.backward()
    r, lpn, a, m = (t.detach().numpy() for t in (rollout, lp, adv, mask))
    ratio = np.exp(lpn - r)
    keep = (m > 0) & (ratio >= 0.8) & (ratio <= 1.25)  # k1 = -log ratio within [log 0.8, log 1.25]
    per_token = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))
    per_token = np.where(a < 0, np.minimum(per_token, -a * 3.0), per_token)
    assert 0 < keep.sum() < (m > 0).sum()
    assert float(loss) == pytest.approx(per_token[keep].mean(), rel=1e-12)
    assert torch.all(lp.grad[torch.tensor(~keep)] == 0)
    assert "rollout_corr/rollout_rs_masked_fraction" in metrics and "actor/pg_clipfrac" in metrics


def test_reinforce_bypass_uses_detached_truncated_is_weights(randn, ragged_mask):
    rollout, lp, adv, mask = _inputs(randn, ragged_mask)
    cfg = {"rollout_is": "token", "rollout_is_threshold": 1.1, "loss_type": "reinforce"}
    loss, metrics = bypass_mode(rollout, lp, adv, mask, params=PolicyLossParams(rollout_correction=cfg))
    loss.backward()
    r, lpn, a, m = (t.detach().numpy() for t in (rollout, lp, adv, mask))
    w = np.minimum(np.exp(lpn - r), 1.1)
    n = m.sum()
    assert float(loss) == pytest.approx((-w * a * lpn * m).sum() / n, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), -w * a * m / n, rtol=1e-10, atol=1e-15)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(((r - lpn) * m).sum() / n, rel=1e-12)
    assert metrics["rollout_corr/rollout_is_max"] <= 1.1


def test_bypass_rejects_unknown_loss_type(randn, ragged_mask):
    rollout, lp, adv, mask = _inputs(randn, ragged_mask)
    with pytest.raises(ValueError, match="loss_type"):
        bypass_mode(rollout, lp, adv, mask, params=PolicyLossParams(rollout_correction={"loss_type": "pg"}))
