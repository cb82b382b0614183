"""Optimal Token Baseline (OTB): a per-token baseline weighted by each trajectory's realized energy.

arXiv:2602.07078 ("optimal token baseline"); verl's ``compute_optimal_token_baseline_advantage`` and its multi-turn
form ``compute_multi_turn_optimal_token_baseline_advantage`` (``algorithm.adv_estimator=optimal_token_baseline`` /
``tir_optimal_token_baseline``). For row i of a prompt group g, with valid-token mask m:

    G_i,t = sum_{k >= t} r_i,k m_i,k                             reward-to-go
    w_i,t = (1 - 2 pi_i,t + sum_v pi_i,t(v)^2) rho_i,t^2          logit-gradient proxy of ||grad log pi||^2;
                                                                  pi_i,t = exp(old_log_probs), rho = rollout IS
                                                                  weight (1 without rollout correction)
    W_i,t = sum_{j <= t} w_i,j m_i,j                              realized energy up to t
    B_g,t = sum_{i in g} G_i,t W_i,t m_i,t / (sum_{i in g} W_i,t m_i,t + eps)
    A_i,t = (G_i,t - B_g,t) m_i,t                                 returns are G

A group of one gets B = 0 (A = G). ``handle_zero_tail`` (verl's default, on): when one row of a group is strictly
the longest, its tokens past the second-longest row's length have no other trajectory to compare with (B would be
its own G, A = 0); they get B = 0 instead. ``sum_v pi^2`` is ``sum_pi_squared`` from the actor's old-log-prob pass
(``actor.calculate_sum_pi_squared=true``).

The multi-turn form (``tir_``) indexes tokens by their rank among the row's valid tokens instead of their position,
so the k-th model token of each trajectory is compared with the k-th of the others whatever tool answers came
between; rows without a valid token are left out of their group.
"""

from __future__ import annotations

import torch

from lathe.algo.advantages import _fmask, _require
from lathe.algo.registry import register_adv_estimator
from lathe.algo.utils import group_ids

__all__ = ["optimal_token_baseline", "tir_optimal_token_baseline", "path_energy", "variance_proxy_metrics"]


def path_energy(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights=None) -> torch.Tensor:
    """W (B, T): the cumulative sum over valid tokens of ``(1 - 2 pi_t + sum pi^2) rho_t^2``."""
    w = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(w.dtype) ** 2
    mask = response_mask.bool()
    return torch.where(mask, w, torch.zeros_like(w)).cumsum(dim=-1)


def _baselines(returns, energy, mask, groups, epsilon: float, handle_zero_tail: bool) -> torch.Tensor:
    """B (B, T) from G, W and the 0/1 float mask, one group (a tensor of row numbers) at a time."""
    base = torch.zeros_like(returns)
    for rows in groups:
        if len(rows) < 2:
            continue
        m = mask[rows]
        num = (returns[rows] * energy[rows] * m).sum(dim=0)
        den = (energy[rows] * m).sum(dim=0) + epsilon
        base[rows] = (num / den).unsqueeze(0).expand(len(rows), -1)
        if handle_zero_tail:
            lengths = m.sum(dim=-1)
            top2 = torch.topk(lengths, 2).values
            longest = (lengths == top2[0]).nonzero().flatten()
            if len(longest) == 1 and top2[0] > top2[1]:
                base[rows[longest[0]], int(top2[1]):] = 0.0
    return base


def _group_rows(index, batch: int, device, keep: torch.Tensor | None = None) -> list[torch.Tensor]:
    gid, counts = group_ids(index, batch, device)
    if keep is not None:
        gid = torch.where(keep, gid, torch.full_like(gid, -1))
    return [(gid == g).nonzero().flatten() for g in range(len(counts))]


def _inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights, name):
    _require(old_log_probs, "old_log_probs", name)
    _require(sum_pi_squared, "sum_pi_squared (set actor_rollout_ref.actor.calculate_sum_pi_squared=true)", name)
    mask = _fmask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    energy = path_energy(old_log_probs.to(returns.dtype), sum_pi_squared.to(returns.dtype), response_mask,
                         rollout_is_weights)
    return mask, returns, energy


@register_adv_estimator("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline(*, token_level_rewards, response_mask, index=None, old_log_probs=None,
                           sum_pi_squared=None, rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **_):
    """OTB over token positions (see the module docstring). Returns ``(A, G)``, both (B, T)."""
    mask, returns, energy = _inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                    rollout_is_weights, "optimal_token_baseline")
    groups = _group_rows(_require(index, "index", "optimal_token_baseline"), mask.shape[0], mask.device)
    base = _baselines(returns, energy, mask, groups, epsilon, handle_zero_tail)
    return (returns - base) * mask, returns


@register_adv_estimator("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline(*, token_level_rewards, response_mask, index=None, old_log_probs=None,
                               sum_pi_squared=None, rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8,
                               **_):
    """OTB over each row's valid tokens in order (multi-turn: tool answers between turns are skipped). Returns
    ``(A, G)``, both (B, T)."""
    name = "tir_optimal_token_baseline"
    mask, returns, energy = _inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                    rollout_is_weights, name)
    valid = response_mask.bool()
    lengths = valid.sum(dim=-1)
    width = max(int(lengths.max()), 1) if lengths.numel() else 1
    rank = valid.long().cumsum(dim=-1) - 1                       # the k of each valid token
    rows, cols = valid.nonzero(as_tuple=True)
    compact = lambda x: x.new_zeros(x.shape[0], width).index_put_((rows, rank[rows, cols]), x[rows, cols])  # noqa: E731
    c_returns, c_energy = compact(returns), compact(energy)
    c_mask = (torch.arange(width, device=mask.device).unsqueeze(0) < lengths.unsqueeze(-1)).to(mask.dtype)
    groups = _group_rows(_require(index, "index", name), mask.shape[0], mask.device, keep=lengths > 0)
    c_adv = c_returns - _baselines(c_returns, c_energy, c_mask, groups, epsilon, handle_zero_tail)
    adv = torch.zeros_like(returns)
    adv[rows, cols] = c_adv[rows, rank[rows, cols]]
    return adv * mask, returns


@torch.no_grad()
def variance_proxy_metrics(advantages, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights=None,
                           grad_norm: float | None = None) -> dict[str, float]:
    """verl's ``variance_proxy/*`` metrics: the policy gradient's variance estimated from the forward pass alone.

    With ``w_t = 1 - 2 pi_t + sum pi^2`` (x rho_t^2 under rollout IS) per valid token, per trajectory
    ``a_i = mean_t A_i,t``, ``W_i = sum_t w_t``; ``||g_i||^2 ~ W_i a_i^2`` (the logit-gradient proxy):

        proxy1_signal_strength = ||g||^2 = grad_norm^2                (0 without a grad norm)
        proxy2_total_power     = mean_i a_i^2 max(W_i, 0)             (IS: mean_i rho_i^2 a_i^2 max(W0_i, 0) with
                                                                       rho_i = mean_t rho_t, W0 the unweighted W
                                                                       over the tokens with rho_t != 0)
        proxy3_pure_noise      = max(0, (proxy2 - proxy1) / (N - 1))  (0 without a grad norm or with N = 1)
        expected_a_squared     = mean_i a_i^2,   expected_w = mean_i W_i
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    tokens = mask.sum(dim=-1).clamp(min=1).to(advantages.dtype)
    a = torch.where(mask, advantages, zero).sum(dim=-1) / tokens
    w = (1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared).to(advantages.dtype)
    w0 = torch.where(mask, w, zero).sum(dim=-1)
    if rollout_is_weights is None:
        w_values, power = w0, (a ** 2 * w0.clamp(min=0.0)).mean()
    else:
        rho = rollout_is_weights.to(advantages.dtype)
        w_values = torch.where(mask, w * rho ** 2, zero).sum(dim=-1)
        rho_seq = torch.where(mask, rho, zero).sum(dim=-1) / tokens
        w0 = torch.where(mask & (rho != 0), w, zero).sum(dim=-1)      # verl: w rho^2 / max(rho^2, 1e-10)
        power = (rho_seq ** 2 * a ** 2 * w0.clamp(min=0.0)).mean()
    signal = None if grad_norm is None else float(grad_norm) ** 2
    n = a.shape[0]
    noise = 0.0 if signal is None or n < 2 else max(0.0, (float(power) - signal) / (n - 1))
    return {"variance_proxy/proxy1_signal_strength": 0.0 if signal is None else signal,
            "variance_proxy/proxy2_total_power": float(power), "variance_proxy/proxy3_pure_noise": noise,
            "variance_proxy/expected_a_squared": float((a ** 2).mean()),
            "variance_proxy/expected_w": float(w_values.mean())}
