"""Covariance-based entropy-preserving PPO losses: Clip-Cov and KL-Cov.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv:2505.22617). Both act on the few tokens with the largest centred covariance
``cov_{i,t} = (A_{i,t} - mean A) * (log pi_theta_{i,t} - mean log pi_theta)`` (means over valid tokens,
detached), which are the ones that drive entropy collapse. Signatures and metrics as in ``policy_loss``.
"""

from __future__ import annotations

import torch

from lathe.algo.policy_loss import PolicyLossParams, _aggregate, _frac, _metrics, _neg_kl
from lathe.algo.registry import register_policy_loss
from lathe.algo.utils import masked_mean

__all__ = ["clip_cov", "kl_cov", "token_covariance"]


def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor):
    """Centred per-token covariance term (B, T), detached; ``-inf`` on padding."""
    adv = advantages.detach()
    lp = log_prob.detach()
    cov = (adv - masked_mean(adv, response_mask)) * (lp - masked_mean(lp, response_mask))
    return torch.where(response_mask.bool(), cov, torch.full_like(cov, float("-inf")))


@register_policy_loss("clip_cov")
def clip_cov(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
             rollout_is_weights=None, agg_kwargs=None):
    """Clip-Cov: PPO clipping plus a random ``clip_cov_ratio`` share of tokens with gradient cut.

    Candidates are valid tokens not already clipped by PPO whose covariance lies strictly inside
    ``(clip_cov_lb, clip_cov_ub)``; ``max(1, int(clip_cov_ratio * N_valid))`` of them are drawn uniformly
    (torch's global RNG) and their loss is multiplied by 0. ``pg_clipfrac`` is the share of cut tokens.
    """
    p = params or PolicyLossParams()
    valid = response_mask.bool()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask, clamp=False)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - p.low, 1 + p.high)
    cov = token_covariance(advantages, log_prob, response_mask)
    cov = torch.where((loss2 > loss1) & valid, torch.full_like(cov, float("-inf")), cov)
    candidates = torch.nonzero((cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & valid)
    n_cut = max(int(p.clip_cov_ratio * int(valid.sum())), 1)
    keep = torch.ones_like(advantages)
    if len(candidates) > 0:
        pick = candidates[torch.randperm(len(candidates), device=candidates.device)[:n_cut]]
        keep[pick[:, 0], pick[:, 1]] = 0.0
    pg_losses = torch.maximum(loss1, loss2) * keep
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(_frac(keep == 0, response_mask), masked_mean(-neg_kl, response_mask))


@register_policy_loss("kl_cov")
def kl_cov(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
           rollout_is_weights=None, agg_kwargs=None):
    """KL-Cov: unclipped policy gradient plus a KL penalty on the top-covariance tokens.

    ``l = -A r`` everywhere; on the ``max(1, int(kl_cov_ratio * N_valid))`` valid tokens with the largest
    covariance, ``l = -A r + ppo_kl_coef * |log r|``. As in verl, ``actor/ppo_kl`` reports the mean
    ``|log r|`` here.
    """
    p = params or PolicyLossParams()
    valid = response_mask.bool()
    neg_kl = _neg_kl(log_prob, old_log_prob, response_mask, clamp=False)
    abs_kl = neg_kl.abs()
    ratio = torch.exp(neg_kl)
    pg_losses = -advantages * ratio
    n_valid = int(valid.sum())
    if n_valid > 0:
        flat_valid = valid.flatten().nonzero().flatten()
        adv_v = advantages.detach().flatten()[flat_valid]
        lp_v = log_prob.detach().flatten()[flat_valid]
        cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
        top = flat_valid[torch.topk(cov, max(1, int(n_valid * p.kl_cov_ratio))).indices]
        chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        chosen[top] = True
        pg_losses = torch.where(chosen.view_as(valid), pg_losses + p.ppo_kl_coef * abs_kl, pg_losses)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(None, masked_mean(abs_kl, response_mask))
