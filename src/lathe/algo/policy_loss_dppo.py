"""Divergence-masked policy losses (DPPO-Binary-TV, DPPO-Binary-KL) and Direct Reward Optimization (DRO).

Signatures and metrics as in ``policy_loss``. ``ratio = pi_theta / pi_old`` of the sampled token,
``p = pi_theta(y_t)``, ``q = pi_old(y_t)``.

DPPO (arXiv:2602.04879; verl's ``dppo_tv`` / ``dppo_kl``) replaces PPO's ratio clip by a trust region on the
divergence between the two policies' binary distributions over "this token / any other token": a token stops
learning once the update has moved it past the threshold in the direction its advantage pushes. The clip keys are
reread as divergence thresholds: ``delta_high = actor.clip_ratio_high`` (A > 0), ``delta_low =
actor.clip_ratio_low`` (A <= 0), both defaulting to ``actor.clip_ratio``. Instead of a dual clip, the ratio
weighting the gradient is truncated at ``c = actor.clip_ratio_c`` (truncated IS; DPPO's paper recommends a large c):

    keep_t = [p - q <= delta_high]            if A_t > 0      (TV: |p - q| is the binary total variation)
             [p - q >= -delta_low]            otherwise
    keep_t = [KL_b <= delta_high or p <= q]   if A_t > 0      (KL: KL_b = q log(q/p) + (1-q) log((1-q)/(1-p)))
             [KL_b <= delta_low  or p >= q]   otherwise
    l_t    = -A_t sg[min(ratio_t, c)] log p_t sg[keep_t]

``pg_clipfrac`` is the share of masked-out tokens, ``pg_clipfrac_lower`` the share of kept tokens whose ratio was
truncated (verl's metrics).
"""

from __future__ import annotations

import torch

from lathe.algo.policy_loss import PolicyLossParams, _aggregate, _frac, _metrics, _neg_kl
from lathe.algo.registry import register_policy_loss
from lathe.algo.utils import masked_mean

__all__ = ["dppo_tv", "dppo_kl", "dro", "binary_kl"]


def binary_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KL(Bernoulli(q) || Bernoulli(p)) between the old and new probability of each sampled token, (B, T);
    ``eps`` keeps ``log(1 - p)`` finite at p = 1 (verl's constant)."""
    q, p = torch.exp(old_log_prob), torch.exp(log_prob)
    return q * (old_log_prob - log_prob) + (1.0 - q) * torch.log((1.0 - q + eps) / (1.0 - p + eps))


def _dppo(old_log_prob, log_prob, advantages, response_mask, keep_pos, keep_neg, p: PolicyLossParams,
          loss_agg_mode, rollout_is_weights, agg_kwargs):
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(neg_kl)
    truncated = torch.clamp(ratio, max=p.clip_ratio_c).detach()
    keep = torch.where(advantages > 0, keep_pos, keep_neg).detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated * log_prob * keep
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(_frac(keep == 0, response_mask), masked_mean(-neg_kl, response_mask),
                          _frac((ratio > p.clip_ratio_c) & (keep > 0), response_mask))


@register_policy_loss("dppo_tv")
def dppo_tv(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
            rollout_is_weights=None, agg_kwargs=None):
    """DPPO-Binary-TV (arXiv:2602.04879): the token trust region is ``p - q`` within ``[-delta_low, delta_high]``
    on the side the advantage pushes (module docstring)."""
    p = params or PolicyLossParams()
    diff = (torch.exp(log_prob) - torch.exp(old_log_prob)).detach()
    return _dppo(old_log_prob, log_prob, advantages, response_mask, diff <= p.high, diff >= -p.low, p,
                 loss_agg_mode, rollout_is_weights, agg_kwargs)


@register_policy_loss("dppo_kl")
def dppo_kl(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
            rollout_is_weights=None, agg_kwargs=None):
    """DPPO-Binary-KL (arXiv:2602.04879): the token trust region is the binary KL ``KL_b <= delta`` on the side
    the advantage pushes (module docstring)."""
    p = params or PolicyLossParams()
    kl = binary_kl(old_log_prob, log_prob).detach()
    up = (log_prob > old_log_prob).detach()
    down = (log_prob < old_log_prob).detach()
    return _dppo(old_log_prob, log_prob, advantages, response_mask, (kl <= p.high) | ~up, (kl <= p.low) | ~down, p,
                 loss_agg_mode, rollout_is_weights, agg_kwargs)


@register_policy_loss("dro")
def dro(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
        rollout_is_weights=None, agg_kwargs=None):
    """Direct Reward Optimization loss with a quadratic log-ratio penalty (verl's ``dro``):

    ``l_t = -(A_t log pi_theta_t - beta / 2 (log pi_theta_t - log pi_old_t)^2)``, ``beta =
    actor.policy_loss.dro_beta`` (> 0, required). DRO expects advantages built for its soft off-policy objective
    (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large
    Language Models Alignment"). No clipping: ``pg_clipfrac`` is 0.
    """
    p = params or PolicyLossParams()
    if p.dro_beta is None or p.dro_beta <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={p.dro_beta}: loss_mode=dro needs a positive "
                         "beta (the weight of its quadratic log-ratio penalty). Fix: set it, e.g. dro_beta=0.1")
    log_ratio = _neg_kl(log_prob, old_log_prob, response_mask, clamp=False)
    pg_losses = -(log_prob * advantages - 0.5 * p.dro_beta * log_ratio.square())
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(None, masked_mean(-log_ratio, response_mask))
