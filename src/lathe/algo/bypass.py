"""Bypass-mode policy loss (``algorithm.rollout_correction.bypass_mode=True``) and the IS-REINFORCE loss.

In bypass mode the trainer skips the old-policy forward and sets ``old_log_prob := rollout_log_prob``
(2 policies instead of 3). The rollout correction is then computed *inside* the loss against the current
policy, ``r = pi_theta / pi_rollout`` (detached), using ``params.rollout_correction`` (the
``algorithm.rollout_correction.*`` keys). ``loss_type`` selects:

* ``ppo_clip``: the vanilla PPO loss with ``pi_old = pi_rollout``; its ratio already is the IS ratio, so no
  extra weights are applied (that would count the correction twice); rejection sampling still masks.
* ``reinforce``: ``l = -w * A * log pi_theta`` with the truncated IS weights ``w`` and no clipping.

Note: rejection here changes the micro-batch mask after ``global_batch_info`` was taken, so rejected tokens
still count in the global denominators (as in verl).
"""

from __future__ import annotations

import torch

from lathe.algo.policy_loss import PolicyLossParams, _aggregate, _metrics, vanilla
from lathe.algo.registry import register_policy_loss
from lathe.algo.rollout_correction import compute_rollout_correction
from lathe.algo.utils import masked_mean

__all__ = ["reinforce_is_loss", "bypass_mode"]


def reinforce_is_loss(rollout_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                      params=None, rollout_is_weights=None, agg_kwargs=None):
    """REINFORCE with optional IS correction: ``l = -sg[w] * A * log pi_theta`` (no clipping).

    ``actor/ppo_kl`` is ``mean(log pi_rollout - log pi_theta)``.
    """
    pg_losses = -advantages * log_prob
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs)
    return loss, _metrics(None, masked_mean(rollout_log_prob - log_prob, response_mask))


@register_policy_loss("bypass_mode")
def bypass_mode(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", params=None,
                rollout_is_weights=None, agg_kwargs=None):
    """Bypass-mode loss; ``old_log_prob`` holds the ROLLOUT log-probs. Any passed IS weights are ignored
    (they are recomputed here against the current policy). Adds the ``rollout_corr/*`` metrics."""
    p = params or PolicyLossParams()
    cfg = dict(p.rollout_correction or {})
    cfg["bypass_mode"] = True
    with torch.no_grad():
        weights, mask, corr_metrics = compute_rollout_correction(log_prob.detach(), old_log_prob, response_mask, **cfg)
    kwargs = {"loss_agg_mode": loss_agg_mode, "params": p, "agg_kwargs": agg_kwargs}
    if cfg.get("loss_type", "ppo_clip") == "reinforce":
        loss, metrics = reinforce_is_loss(old_log_prob, log_prob, advantages, mask, rollout_is_weights=weights,
                                          **kwargs)
    else:
        loss, metrics = vanilla(old_log_prob, log_prob, advantages, mask, rollout_is_weights=None, **kwargs)
    metrics.update(corr_metrics)
    return loss, metrics
