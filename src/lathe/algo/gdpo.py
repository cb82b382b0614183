"""GDPO: group reward-decoupled normalisation over several reward components (``algorithm.adv_estimator=gdpo``).

"GDPO: Group reward-Decoupled Normalization Policy Optimization" (arXiv:2601.05242); verl's
``compute_gdpo_outcome_advantage``. GRPO sums the reward components first and normalises the sum, so a component
with a large spread drowns the others; GDPO normalises each component within its prompt group, then combines:

    A_k,i   = (r_k,i - mean_g(r_k)) / (std_g(r_k) + eps)        per component k, group g of row i (GRPO's rule:
                                                               unbiased std, a lone sample has mean 0 and std 1;
                                                               no division when norm_adv_by_std_in_grpo=False)
    S_i     = sum_k w_k A_k,i                                   w = algorithm.gdpo_reward_weights (default all 1)
    A_i,t   = whiten(S broadcast over the response)_i,t         mean/unbiased std over every valid token of the
                                                               batch (verl's masked_whiten), 0 on padding

The components are the scorer's own numbers per response (``reward_components``, one column per name in
``algorithm.gdpo_reward_keys``); ``token_level_rewards`` is not used (as in verl, so the in-reward KL penalty and
DAPO's overlong shaping do not enter GDPO's advantage).
"""

from __future__ import annotations

import torch

from lathe.algo.advantages import _fmask, _group_stats, _require
from lathe.algo.registry import register_adv_estimator
from lathe.algo.utils import masked_whiten

__all__ = ["gdpo"]


@register_adv_estimator("gdpo")
@torch.no_grad()
def gdpo(*, response_mask, index=None, reward_components=None, reward_weights=None, norm_adv_by_std_in_grpo=True,
         epsilon=1e-6, **_):
    """GDPO advantage (see the module docstring). ``reward_components``: (B, K) scores, column k the reward key
    k; ``reward_weights``: K weights or None (all 1). Returns ``(A, A)``, both (B, T)."""
    comps = _require(reward_components, "reward_components", "gdpo")
    if comps.dim() != 2 or comps.shape[0] != response_mask.shape[0]:
        raise ValueError(f"gdpo: reward_components has shape {tuple(comps.shape)}; expected (batch, keys) with "
                         f"batch = {response_mask.shape[0]}")
    k = comps.shape[1]
    if reward_weights is None:
        weights = torch.ones(k, dtype=comps.dtype, device=comps.device)
    else:
        weights = torch.as_tensor(list(reward_weights), dtype=comps.dtype, device=comps.device)
        if weights.numel() != k:
            raise ValueError(f"algorithm.gdpo_reward_weights has {weights.numel()} weights for {k} reward keys; "
                             "give one weight per key of algorithm.gdpo_reward_keys (or none for equal weights)")
    combined = torch.zeros(comps.shape[0], dtype=comps.dtype, device=comps.device)
    for j in range(k):
        scores = comps[:, j]
        mean, std, _, _ = _group_stats(scores, index, "gdpo")
        normed = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        combined = combined + weights[j] * normed
    mask = _fmask(response_mask, combined)
    adv = masked_whiten(combined.unsqueeze(-1) * mask, response_mask) * mask
    return adv, adv
