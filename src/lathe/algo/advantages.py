"""Advantage estimators, registered under verl's ``algorithm.adv_estimator`` names.

Every estimator is called with the same keywords (extra ones are ignored through ``**_``)::

    fn(*, token_level_rewards, response_mask, index=None, values=None, gamma=1.0, lam=1.0,
       norm_adv_by_std_in_grpo=True, reward_baselines=None, epsilon=1e-6) -> (advantages, returns)

Shapes: ``token_level_rewards``, ``response_mask``, ``values`` are (B, T) response-aligned; ``index`` holds one
prompt id per row (np.ndarray or list; rows with the same id are one prompt's samples); ``reward_baselines``
is (B,). Both outputs are (B, T) and zero on padding. Outcome-reward estimators use the per-sequence score
``s_i = sum_t r_{i,t}``. Everything runs under ``torch.no_grad()``: advantages are targets, not graph nodes.

Edge cases follow verl: a prompt group of size 1 gets mean 0 and std 1 (so GRPO returns ``s / (1 + eps)``),
RLOO leaves a lone sample's score unchanged, and ``grpo_passk`` requires at least two samples per group.
"""

from __future__ import annotations

import torch

from lathe.algo.registry import register_adv_estimator
from lathe.algo.utils import group_ids, masked_mean, masked_var, masked_whiten

__all__ = [
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]


def _require(value, what: str, estimator: str):
    if value is None:
        raise ValueError(f"adv_estimator '{estimator}' needs `{what}`, but it was None; pass it from the batch")
    return value


def _fmask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return response_mask.to(like.dtype)


def _group_stats(scores: torch.Tensor, index, estimator: str):
    """Per-row group mean, unbiased std and size; singleton groups get mean 0, std 1 (verl)."""
    gid, counts = group_ids(_require(index, "index", estimator), scores.shape[0], scores.device)
    n = counts.to(scores.dtype)
    mean = torch.zeros_like(n).index_add_(0, gid, scores) / n
    sq = torch.zeros_like(n).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid], gid


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor):
    adv = per_row.unsqueeze(-1) * _fmask(response_mask, per_row)
    return adv, adv


@register_adv_estimator("gae")
@torch.no_grad()
def gae(*, token_level_rewards, response_mask, values=None, gamma=1.0, lam=1.0, **_):
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), whitened.

    Over valid tokens only (padding and multi-turn observation tokens are skipped, as in verl):
    ``delta_t = r_t + gamma * V_{next valid} - V_t``, ``A_t = delta_t + gamma * lam * A_{next valid}``,
    ``returns = A + V`` (before whitening), then ``A`` is whitened over the mask. With gamma = lam = 1,
    ``A_t = sum_{k>=t valid} r_k - V_t``. Needs ``values`` (B, T) from the critic.
    """
    values = _require(values, "values", "gae")
    mask = _fmask(response_mask, token_level_rewards)
    next_v = torch.zeros_like(token_level_rewards[:, 0])
    last = torch.zeros_like(next_v)
    adv = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_v - values[:, t]
        last = m * (delta + gamma * lam * last) + (1 - m) * last
        next_v = m * values[:, t] + (1 - m) * next_v
        adv[:, t] = last
    returns = (adv + values) * mask
    return masked_whiten(adv, response_mask) * mask, returns


@register_adv_estimator("grpo")
@torch.no_grad()
def grpo(*, token_level_rewards, response_mask, index=None, norm_adv_by_std_in_grpo=True, epsilon=1e-6, **_):
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased std of the prompt group g, broadcast over the
    response. ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO's ``A_i = s_i - mean_g`` (Liu et al. 2025,
    arXiv:2503.20783).
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _, _ = _group_stats(scores, index, "grpo")
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    return _broadcast(adv, response_mask)


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def grpo_passk(*, token_level_rewards, response_mask, index=None, norm_adv_by_std_in_grpo=True, epsilon=1e-6, **_):
    """Pass@k advantage (Chen et al. 2025, arXiv:2503.19595): only each group's best sample learns.

    ``A_best = (s_max - s_second) / (std_g + eps)`` (no division when ``norm_adv_by_std_in_grpo=False``);
    every other sample gets 0. Ties for the best go to the first row. Groups need at least 2 samples.
    """
    scores = token_level_rewards.sum(dim=-1)
    _, std, counts, gid = _group_stats(scores, index, "grpo_passk")
    if bool((counts < 2).any()):
        row = int((counts < 2).nonzero()[0])
        raise ValueError(f"grpo_passk needs >= 2 samples per prompt group; row {row} is alone (set rollout.n >= 2)")
    adv = torch.zeros_like(scores)
    for g in torch.unique(gid).tolist():
        rows = (gid == g).nonzero().flatten()
        top2 = torch.topk(scores[rows], 2).values
        best = rows[int(torch.argmax(scores[rows]))]
        gap = top2[0] - top2[1]
        adv[best] = gap / (std[best] + epsilon) if norm_adv_by_std_in_grpo else gap
    return _broadcast(adv, response_mask)


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo(*, token_level_rewards, response_mask, index=None, **_):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740).

    ``A_i = s_i - mean_{j != i in g} s_j = (n s_i - sum_g s) / (n - 1)``; a lone sample keeps ``s_i``.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, counts, _ = _group_stats(scores, index, "rloo")
    n = counts.to(scores.dtype)
    adv = torch.where(counts > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    return _broadcast(adv, response_mask)


@register_adv_estimator("opo")
@torch.no_grad()
def opo(*, token_level_rewards, response_mask, index=None, **_):
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585).

    Length-weighted group baseline: ``b_g = sum_j |y_j| s_j / sum_j |y_j|``, ``A_i = s_i - b_g``; a lone
    sample gets ``b = 0``. ``|y_j|`` is the number of valid tokens of row j.
    """
    scores = token_level_rewards.sum(dim=-1)
    lengths = _fmask(response_mask, scores).sum(dim=-1)
    _, _, counts, gid = _group_stats(scores, index, "opo")
    num = torch.zeros(int(gid.max()) + 1, dtype=scores.dtype, device=scores.device)
    den = torch.zeros_like(num)
    num.index_add_(0, gid, lengths * scores)
    den.index_add_(0, gid, lengths)
    base = torch.where(counts > 1, num[gid] / den[gid].clamp(min=1e-12), torch.zeros_like(scores))
    return _broadcast(scores - base, response_mask)


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg(*, token_level_rewards, response_mask, index=None, **_):
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv:2504.02546).

    ``A_i = alpha * (s_i - mean_g) / F_norm`` with ``alpha = B / max(1, #{i: s_i != 0})`` (the batch's
    share of non-zero scores) and ``F_norm = 1``, as in verl; a lone sample has mean 0.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _, _ = _group_stats(scores, index, "gpg")
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    return _broadcast(alpha * (scores - mean), response_mask)


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(*, token_level_rewards, response_mask, gamma=1.0, **_):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    ``G_t = r_t + gamma * G_{t+1}`` restarted after the last valid token; ``A = whiten(G)`` over the mask.
    Returns ``(A, G)``.
    """
    mask = _fmask(response_mask, token_level_rewards)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, response_mask) * mask, returns * mask


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(*, token_level_rewards, response_mask, index=None, **_):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group-mean baseline, then batch whitening.

    ``A_i = s_i - mean_g`` broadcast over the response, then whitened over all valid tokens of the batch
    (so long responses weigh more in the statistics, as in verl). A lone sample has mean 0.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _, _ = _group_stats(scores, index, "reinforce_plus_plus_baseline")
    mask = _fmask(response_mask, scores)
    centred = (scores - mean).unsqueeze(-1) * mask
    adv = masked_whiten(centred, response_mask) * mask
    return adv, adv


@register_adv_estimator("remax")
@torch.no_grad()
def remax(*, token_level_rewards, response_mask, reward_baselines=None, **_):
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy rollout's score is the baseline.

    ``G_t = sum_{k>=t} r_k m_k`` (undiscounted return-to-go), ``A_t = G_t - b_i`` on valid tokens, with
    ``b_i = reward_baselines[i]`` the score of the greedy response to the same prompt. Returns ``(A, G)``.
    """
    base = _require(reward_baselines, "reward_baselines", "remax")
    mask = _fmask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    base = torch.as_tensor(base, dtype=returns.dtype, device=returns.device).reshape(-1)
    return (returns - base.unsqueeze(-1)) * mask, returns
