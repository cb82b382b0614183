"""Policy-gradient losses (verl's ``actor.policy_loss.loss_mode``), the value loss and the entropy loss.

Every registered loss has the signature::

    fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
       rollout_is_weights=None, agg_kwargs=None) -> (loss, metrics)

All tensors are (B, T). ``loss`` is a scalar to MINIMISE (the negated objective), aggregated with
``agg_loss(..., **agg_kwargs)`` (pass ``global_batch_info(...)`` for split-invariant micro-batching).
``rollout_is_weights`` (B, T, detached) multiply the per-token losses (rollout correction, decoupled mode).
``metrics`` always holds ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` as
detached 0-d tensors (no host sync; 0 where a loss has no such notion). ``ratio = pi_theta / pi_old``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.algo.aggregate import agg_loss
from lathe.algo.registry import register_policy_loss
from lathe.algo.utils import masked_mean, masked_sum

__all__ = [
    "PolicyLossParams",
    "vanilla",
    "gspo",
    "gpg",
    "cispo",
    "sapo",
    "geo_mean",
    "compute_value_loss",
    "compute_entropy_loss",
]


@dataclass
class PolicyLossParams:
    """Hyper-parameters of the policy losses, with verl's names and defaults (``actor.*`` /
    ``actor.policy_loss.*``)."""

    clip_ratio: float = 0.2  # PPO epsilon (Schulman et al. 2017)
    clip_ratio_low: float | None = None  # lower epsilon; None -> clip_ratio
    clip_ratio_high: float | None = None  # upper epsilon (DAPO clip-higher); None -> clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for A < 0 (Ye et al. 2020, arXiv:1912.09729); must be > 1
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # Clip-Cov: covariance band lower bound
    clip_cov_ub: float = 5.0  # Clip-Cov: covariance band upper bound
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # KL-Cov: penalty coefficient
    tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO gate temperature for A <= 0
    dro_beta: float | None = None  # DRO: weight of the quadratic log-ratio penalty; required (> 0) by loss_mode=dro
    rollout_correction: dict | None = None  # bypass_mode: algorithm.rollout_correction.* keys

    def __post_init__(self):
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip lower bound)")
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "tau_pos", "tau_neg"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"actor.{key}={value} must be > 0")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def _metrics(clipfrac, ppo_kl, clipfrac_lower=None) -> dict:
    zero = torch.zeros((), device=ppo_kl.device)
    return {
        "actor/pg_clipfrac": (zero if clipfrac is None else clipfrac).detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": (zero if clipfrac_lower is None else clipfrac_lower).detach(),
    }


def _neg_kl(log_prob, old_log_prob, response_mask, clamp: bool = True) -> torch.Tensor:
    """``log(pi_theta / pi_old)``, set to 0 on padding (so an ``exp`` there can never overflow and poison the
    backward pass with ``0 * inf``) and clamped to [-20, 20] where verl clamps."""
    d = torch.where(response_mask.bool(), log_prob - old_log_prob, torch.zeros_like(log_prob))
    return torch.clamp(d, min=-20.0, max=20.0) if clamp else d


def _frac(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(cond.float(), mask)


def _aggregate(pg_losses, mask, mode, rollout_is_weights, agg_kwargs) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return agg_loss(pg_losses, mask, mode, **(agg_kwargs or {}))


@register_policy_loss("vanilla")
def vanilla(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
            rollout_is_weights=None, agg_kwargs=None):
    """PPO clipped surrogate (arXiv:1707.06347) with clip-higher (DAPO) and dual-clip (arXiv:1912.09729).

    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for ``A < 0`` additionally
    ``l = min(l, -A c)`` with ``c = clip_ratio_c``. ``pg_clipfrac`` counts tokens where the clipped term
    is strictly larger (a ratio exactly on the boundary is not clipped); ``pg_clipfrac_lower`` counts
    ``A < 0`` tokens where the dual clip binds. ``ppo_kl = mean(log pi_old - log pi_theta)``.
    """
    p = params or PolicyLossParams()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - p.low, 1 + p.high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * p.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss3, clipped), clipped)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(
        _frac(loss2 > loss1, response_mask),
        masked_mean(-neg_kl, response_mask),
        _frac((clipped > loss3) & negative, response_mask),
    )


@register_policy_loss("gspo")
def gspo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
         rollout_is_weights=None, agg_kwargs=None):
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    Sequence ratio ``s_i = exp(mean_t log(pi_theta / pi_old))``; per token
    ``s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]`` (value ``s_i``, gradient of a token ratio),
    ``l = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high))``. As in verl the loss is always
    aggregated ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored).
    """
    p = params or PolicyLossParams()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask, clamp=False)
    seq_len = response_mask.bool().sum(dim=-1).clamp(min=1).to(neg_kl.dtype)
    seq_neg_kl = masked_sum(neg_kl, response_mask, dim=-1) / seq_len
    log_s = log_prob - log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1 - p.low, 1 + p.high)
    pg_losses = torch.maximum(loss1, loss2)
    loss = _aggregate(pg_losses, response_mask, "seq-mean-token-mean", rollout_is_weights, agg_kwargs)
    return loss, _metrics(_frac(loss2 > loss1, response_mask), masked_mean(-neg_kl, response_mask))


@register_policy_loss("gpg")
def gpg(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
        rollout_is_weights=None, agg_kwargs=None):
    """Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE ``l = -A log pi_theta``."""
    pg_losses = -advantages * log_prob
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(None, masked_mean(-_neg_kl(log_prob, old_log_prob, response_mask), response_mask))


@register_policy_loss("cispo")
def cispo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
          rollout_is_weights=None, agg_kwargs=None):
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585).

    ``l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi_theta``: the clipped ratio only weights the
    REINFORCE gradient, so clipped tokens still learn. ``pg_clipfrac`` counts ``r != clip(r)``.
    """
    p = params or PolicyLossParams()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(neg_kl)
    clipped = torch.clamp(ratio, 1 - p.low, 1 + p.high).detach()
    pg_losses = -clipped * advantages * log_prob
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(_frac(ratio != clipped, response_mask), masked_mean(-neg_kl, response_mask))


@register_policy_loss("sapo")
def sapo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
         rollout_is_weights=None, agg_kwargs=None):
    """Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347).

    Smooth gate instead of a hard clip: ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` if
    ``A > 0`` else ``tau_neg``; ``l = -f(r) A``. As in verl, aggregated ``seq-mean-token-mean`` always.
    """
    p = params or PolicyLossParams()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(neg_kl)
    tau_pos, tau_neg = (torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in (p.tau_pos, p.tau_neg))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    loss = _aggregate(pg_losses, response_mask, "seq-mean-token-mean", rollout_is_weights, agg_kwargs)
    return loss, _metrics(None, masked_mean(-neg_kl, response_mask))


def _seq_mean(values: torch.Tensor, response_mask: torch.Tensor, agg_kwargs: dict | None) -> torch.Tensor:
    """Mean of per-sequence values over sequences with a valid token (global count when given)."""
    valid = response_mask.bool().any(dim=-1)
    n = (agg_kwargs or {}).get("global_num_seqs")
    n = valid.sum() if n is None else n
    total = torch.where(valid, values, torch.zeros_like(values)).sum()
    return total / torch.as_tensor(n, dtype=values.dtype, device=values.device).clamp(min=1)


@register_policy_loss("geo_mean")
def geo_mean(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
             rollout_is_weights=None, agg_kwargs=None):
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios are clipped in the direction of the advantage sign, ``d~ = sgn(A) min(sgn(A) d,
    sgn(A) clip(d, -eps_low, eps_high))``; the sequence ratio is their geometric mean
    ``R_i = exp(mean_t d~)`` and ``l_i = -mean_t(A) R_i`` (sequence-level advantages). Sequences are then
    averaged (global ``N_seq`` when given); ``loss_agg_mode`` does not apply. IS weights enter as their
    per-sequence geometric mean.
    """
    p = params or PolicyLossParams()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask, clamp=False)
    sign = torch.sign(advantages)
    clamped = torch.clamp(neg_kl, -p.low, p.high)
    d = sign * torch.minimum(sign * neg_kl, sign * clamped)
    seq_len = response_mask.bool().sum(dim=-1).clamp(min=1).to(d.dtype)
    ratio = torch.exp(masked_sum(d, response_mask, dim=-1) / seq_len)
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / seq_len
    pg_losses = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, response_mask, dim=-1) / seq_len)
    loss = _seq_mean(pg_losses, response_mask, agg_kwargs)
    was_clipped = neg_kl != clamped
    return loss, _metrics(
        _frac(was_clipped & (advantages > 0), response_mask),
        masked_mean(-neg_kl, response_mask),
        _frac(was_clipped & (advantages < 0), response_mask),
    )


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
                       agg_kwargs=None):
    """Clipped value loss (PPO; Schulman et al. 2017), ``critic.cliprange_value``.

    ``v~ = clip(v_pred, v_old - c, v_old + c)``; ``l = max((v_pred - R)^2, (v~ - R)^2)``; loss
    ``0.5 * agg(l)``. Returns ``(loss, clipfrac)`` with clipfrac the share of tokens where the clipped
    error is strictly larger. ``cliprange_value=None`` disables clipping.
    """
    err1 = (vpreds - returns) ** 2
    if cliprange_value is None:
        err2 = err1
    else:
        vclipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
        err2 = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(err1, err2), response_mask, loss_agg_mode, **(agg_kwargs or {}))
    return loss, _frac(err2 > err1, response_mask).detach()


def compute_entropy_loss(entropy, response_mask, loss_agg_mode="token-mean", agg_kwargs=None):
    """Aggregated token entropy (B, T) -> scalar; the trainer subtracts ``entropy_coeff *`` this."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **(agg_kwargs or {}))
