import numpy as np
import pytest
import torch

from lathe.algo.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)


def _ref(d: np.ndarray, name: str) -> np.ndarray:
    """Schulman's estimators from d = log pi - log pi_ref (k3 with verl's clamps)."""
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return np.abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    x = np.clip(-d, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_estimator_values(randn, name):
    lp, ref = randn(3, 5), randn(3, 5)
    lp[0, 0], ref[0, 0] = 0.0, 30.0  # exercises the k3 clamps
    out = kl_penalty(lp, ref, name)
    np.testing.assert_allclose(out.numpy(), _ref((lp - ref).numpy(), name), rtol=1e-12)


def test_k3_is_nonnegative_and_unbiased_in_expectation():
    torch.manual_seed(0)
    p = torch.distributions.Normal(0.0, 1.0)
    q = torch.distributions.Normal(0.3, 1.0)
    x = p.sample((200_000,)).double()
    lp, lq = p.log_prob(x), q.log_prob(x)
    k3 = kl_penalty(lp, lq, "k3")
    assert torch.all(k3 >= 0)
    assert float(k3.mean()) == pytest.approx(0.045, abs=3e-3)  # KL = 0.3^2 / 2


@pytest.mark.parametrize("name", ["k1+", "kl+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_value_of_base_gradient_of_k2(randn, name):
    lp = randn(2, 4).requires_grad_(True)
    ref = randn(2, 4)
    out = kl_penalty(lp, ref, name)
    d = (lp - ref).detach().numpy()
    np.testing.assert_allclose(out.detach().numpy(), _ref(d, name.rstrip("+")), rtol=1e-12)
    out.sum().backward()
    np.testing.assert_allclose(lp.grad.numpy(), d, rtol=1e-12)  # d/d lp of d^2/2


def test_k2_plus_is_plain_k2(randn):
    lp, ref = randn(2, 3), randn(2, 3)
    assert torch.equal(kl_penalty(lp, ref, "k2+"), kl_penalty(lp, ref, "k2"))
    assert "k3+" in KL_PENALTIES and "full" not in KL_PENALTIES


def test_unknown_estimator_suggests_closest(randn):
    with pytest.raises(ValueError, match="Did you mean 'low_var_kl'"):
        kl_penalty(randn(1, 2), randn(1, 2), "low_var_k")


def test_adaptive_controller_follows_ziegler_update():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    value = 0.2
    for current, steps in [(0.15, 64), (0.5, 64), (0.0, 32), (0.1, 10)]:
        err = min(max(current / 0.1 - 1, -0.2), 0.2)
        value *= 1 + err * steps / 1000
        ctrl.update(current, steps)
        assert ctrl.value == pytest.approx(value, rel=1e-12)


def test_controller_state_round_trip_resumes_exactly():
    a = AdaptiveKLController(0.05, 0.02, 500)
    a.update(0.1, 100)
    b = AdaptiveKLController(0.05, 0.02, 500)
    b.load_state_dict(a.state_dict())
    a.update(0.03, 10)
    b.update(0.03, 10)
    assert a.value == b.value != 0.05
    f = FixedKLController(0.3)
    f.update(10.0, 5)
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3


def test_make_kl_controller_validates():
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    assert isinstance(make_kl_controller("adaptive", kl_coef=0.1, horizon=10, target_kl=0.1), AdaptiveKLController)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", horizon=0)
    with pytest.raises(ValueError, match="Known: adaptive, fixed"):
        make_kl_controller("adaptiv")


def test_apply_kl_penalty_rewards_metrics_and_update(randn, ragged_mask):
    scores, old, ref, mask = randn(4, 5), randn(4, 5), randn(4, 5), ragged_mask(4, 5)
    ctrl = AdaptiveKLController(0.1, 0.05, 100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    m = mask.numpy()
    kld = (old - ref).numpy() * m
    np.testing.assert_allclose(rewards.numpy(), scores.numpy() - 0.1 * kld, rtol=1e-12)
    batch_kl = np.mean([kld[i][m[i] > 0].mean() for i in range(4)])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(batch_kl, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # beta before the update
    err = np.clip(batch_kl / 0.05 - 1, -0.2, 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * 4 / 100), rel=1e-12)
