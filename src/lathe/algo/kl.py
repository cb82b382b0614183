"""KL estimators, KL controllers and the in-reward KL penalty (verl's ``algorithm.kl_ctrl`` / ``kl_penalty``).

Estimators of ``KL(pi || pi_ref)`` per token, from samples of ``pi`` (Schulman 2020, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), with ``d = logprob - ref_logprob``:

* ``kl`` / ``k1``: ``d`` (unbiased, high variance, can be negative)
* ``abs``: ``|d|``
* ``mse`` / ``k2``: ``d^2 / 2`` (biased, low variance; its gradient is the true KL gradient)
* ``low_var_kl`` / ``k3``: ``exp(-d) - 1 + d``, with ``d`` clamped to [-20, 20] and the result to [-10, 10]
* ``<name>+`` (e.g. ``k1+``, ``k3+``, ``low_var_kl+``): straight-through -- the *value* of ``<name>`` with
  the *gradient* of ``k2`` (``k2+`` / ``mse+`` are plain k2).
"""

from __future__ import annotations

import numpy as np
import torch

from lathe.algo.registry import unknown_name_error
from lathe.algo.utils import masked_mean

__all__ = [
    "KL_PENALTIES",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
]

_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES: tuple[str, ...] = _BASE + tuple(f"{n}+" for n in _BASE)


def _forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    d = logprob - ref_logprob
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return d.abs()
    if name in ("mse", "k2"):
        return 0.5 * d.square()
    # low_var_kl / k3: ratio = pi_ref / pi; kl = ratio - log(ratio) - 1
    log_ratio = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) between the policy and the reference (names in ``KL_PENALTIES``)."""
    if kl_penalty not in KL_PENALTIES:
        raise unknown_name_error("KL estimator", "kl_penalty", kl_penalty, KL_PENALTIES)
    base = kl_penalty.rstrip("+")
    value = _forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), ``kl_ctrl.type=adaptive``.

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for the adaptive controller")
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for the adaptive controller")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward the value that keeps the observed KL at ``target_kl``."""
        error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def make_kl_controller(type: str = "fixed", kl_coef: float = 0.001, horizon: int = 10000, target_kl: float = 0.1):
    """Build the controller named by ``algorithm.kl_ctrl`` (verl keys: type, kl_coef, horizon, target_kl)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise unknown_name_error("KL controller", "algorithm.kl_ctrl.type", type, ("fixed", "adaptive"))


def _batch_kl(old_log_prob, ref_log_prob, response_mask, name):
    """Masked per-token KL (zero on padding) and the batch KL: mean over rows of the per-row token mean."""
    kld = kl_penalty(old_log_prob, ref_log_prob, name)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    return kld, float(masked_mean(kld, response_mask, dim=-1).mean())


@torch.no_grad()
def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_ctrl, kl_penalty="kl"):
    """In-reward KL penalty (``algorithm.use_kl_in_reward=True``), as in verl's trainer.

    ``token_level_rewards = token_level_scores - beta * KL_t`` with ``KL_t`` the chosen estimator on valid
    tokens and ``beta = kl_ctrl.value`` *before* the update. The batch KL (mean over sequences of the
    per-sequence token mean) then updates the controller with ``n_steps = batch size``.
    Metrics: ``actor/reward_kl_penalty`` (that batch KL) and ``actor/reward_kl_penalty_coeff`` (beta).
    """
    kld, current_kl = _batch_kl(old_log_prob, ref_log_prob, response_mask, kl_penalty)
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return rewards, metrics
