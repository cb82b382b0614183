"""On-policy distillation losses (verl's ``distillation.distillation_loss.*``): the student samples, a frozen teacher
scores the student's own tokens, and the student is pulled towards the teacher on those tokens.

On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", GKD, arXiv:2306.13649) minimises a divergence between student ``pi`` and teacher ``q`` on
sequences sampled from the student. The per-token *reverse* KL ``KL(pi || q)`` at position t is estimated from the
sampled token ``y_t ~ pi`` with the single-sample estimators of Schulman ("Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html), with ``d = log pi(y_t) - log q(y_t)``:

* ``k1`` / ``kl``: ``d`` (unbiased, can be negative)        * ``abs``: ``|d|``
* ``k2`` / ``mse``: ``d^2 / 2``                              * ``k3`` / ``low_var_kl``: ``exp(-d) - 1 + d``

(``lathe.algo.kl.kl_penalty``, the same estimators verl's distillation calls). The per-token loss ``l_t`` is then
clamped to ``[-loss_max_clamp, loss_max_clamp]`` when that is set, and enters the actor's loss one of two ways:

* ``use_policy_gradient=true`` (Thinking Machines, "On-Policy Distillation", 2025: the negative reverse KL as a
  per-token reward): ``A_t = -l_t`` (detached) is the advantage of PPO's clipped surrogate (``vanilla``, with the
  distillation group's own ``clip_ratio*``) on the student's current log-probs. k1 is the usual choice.
* ``use_policy_gradient=false`` (GKD's supervised form): ``l_t`` itself is aggregated (``loss_agg_mode``) and
  back-propagated; k1 is refused there (its gradient does not depend on the teacher: E_pi[grad log pi] = 0).

With ``use_task_rewards=true`` the actor's loss is ``task_loss + distillation_loss_coef * distill_loss``; with
false it is ``distill_loss`` alone (the task rewards are still computed and logged).

``forward_kl_topk`` (verl's; best as the supervised loss) is the forward KL restricted to the teacher's k most likely
tokens K at each position, ``l_t = sum_{v in K} q(v) (log q(v) - log pi(v))``, both log-probs clamped below at
``log_prob_min_clamp`` and the sum at 0 (GKD's forward-KL divergence, truncated to the teacher's top k); it reads the
student's log-probs of the teacher's top-k tokens from the training forward (``lathe.train.topk``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lathe.algo.aggregate import agg_loss
from lathe.algo.kl import kl_penalty
from lathe.algo.policy_loss import PolicyLossParams, vanilla

__all__ = ["ESTIMATOR_MODES", "TOPK_MODES", "DistillationParams", "distillation_token_losses", "distillation_loss",
           "combine_losses", "forward_kl_topk", "topk_losses"]

ESTIMATOR_MODES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES: tuple[str, ...] = ("forward_kl_topk",)


@dataclass(frozen=True)
class DistillationParams:
    """verl's ``distillation.distillation_loss`` keys, as the loss reads them."""

    loss_mode: str = "k3"
    use_policy_gradient: bool = False
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    topk: int | None = None

    def __post_init__(self):
        if self.loss_mode not in ESTIMATOR_MODES + TOPK_MODES:
            raise ValueError(f"distillation.distillation_loss.loss_mode={self.loss_mode!r}: the actor's loss runs "
                             f"one of {', '.join(ESTIMATOR_MODES + TOPK_MODES)}")
        if self.use_topk and (self.topk is None or self.topk < 1):
            raise ValueError(f"distillation.distillation_loss.topk={self.topk}: loss_mode={self.loss_mode} needs "
                             "k >= 1 (e.g. 32)")
        if self.loss_mode in ("k1", "kl") and not self.use_policy_gradient:
            raise ValueError("distillation.distillation_loss.loss_mode=k1 with use_policy_gradient=false: the "
                             "gradient of k1 does not depend on the teacher. Fix: set use_policy_gradient=true, or "
                             "loss_mode=k3")

    @property
    def use_topk(self) -> bool:
        """Whether the loss reads the teacher's top-k tokens (else the sampled token's log-probs)."""
        return self.loss_mode in TOPK_MODES


def distillation_token_losses(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                              loss_mode: str) -> torch.Tensor:
    """(B, T) per-token reverse-KL estimate of ``KL(student || teacher)`` at the student's sampled tokens
    (``loss_mode`` one of ``ESTIMATOR_MODES``; ``d = log pi - log q``: see the module docstring)."""
    return kl_penalty(student_log_probs, teacher_log_probs, loss_mode)


def distillation_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor | None,
                      response_mask: torch.Tensor, params: DistillationParams, *, loss_agg_mode: str = "token-mean",
                      agg_kwargs: dict | None = None, rollout_is_weights: torch.Tensor | None = None,
                      token_losses: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the distillation loss, a scalar; verl's ``distillation/*`` metrics) of one (micro-)batch.

    ``log_prob`` (B, T): the student's current log-probs (with gradient); ``old_log_prob``: pi_old of the PPO ratio
    (``use_policy_gradient``); ``teacher_log_prob``: the teacher's log-probs of the same tokens. Metrics:
    ``distillation/abs_loss`` (mean |l_t| before clamping), ``distillation/loss_min`` / ``loss_max`` (over the
    valid tokens, before clamping) and, with the policy gradient, ``distillation/pg_clipfrac``, ``ppo_kl`` and
    ``pg_clipfrac_lower`` of its surrogate. ``token_losses`` (B, T): per-token losses computed elsewhere (the top-k
    forward KL: ``topk_losses``), used in place of the estimator on ``teacher_log_prob``."""
    valid = response_mask.bool()
    losses = (token_losses if token_losses is not None
              else distillation_token_losses(log_prob, teacher_log_prob, params.loss_mode))
    seen = losses.detach()[valid]
    empty = seen.numel() == 0                  # no valid token: extremes that any other micro-batch's replace
    metrics = {"distillation/abs_loss": seen.new_zeros(()) if empty else seen.abs().mean(),
               "distillation/loss_min": seen.new_full((), math.inf) if empty else seen.min(),
               "distillation/loss_max": seen.new_full((), -math.inf) if empty else seen.max()}
    if params.loss_max_clamp is not None:                     # the min side bounds k1, which can be negative
        losses = losses.clamp(min=-params.loss_max_clamp, max=params.loss_max_clamp)
    if not params.use_policy_gradient:
        return agg_loss(losses, response_mask, loss_agg_mode, **(agg_kwargs or {})), metrics
    ppo = PolicyLossParams(clip_ratio=params.clip_ratio, clip_ratio_low=params.clip_ratio_low,
                           clip_ratio_high=params.clip_ratio_high)
    loss, pg = vanilla(old_log_prob, log_prob, -losses.detach(), response_mask, loss_agg_mode=loss_agg_mode,
                       params=ppo, rollout_is_weights=rollout_is_weights, agg_kwargs=agg_kwargs)
    metrics.update({"distillation/" + k.removeprefix("actor/"): v for k, v in pg.items()})
    return loss, metrics


def combine_losses(task_loss: torch.Tensor, distill_loss: torch.Tensor, params: DistillationParams) -> torch.Tensor:
    """The actor's loss: ``task_loss + distillation_loss_coef * distill_loss`` with ``use_task_rewards``, else
    ``distill_loss`` alone (verl's coefficient is 1 then)."""
    if not params.use_task_rewards:
        return distill_loss
    return task_loss + params.distillation_loss_coef * distill_loss


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor, *,
                    log_prob_min_clamp: float | None = None) -> torch.Tensor:
    """Top-k forward KL (verl's ``forward_kl_topk``): per token ``sum_{v in K} q(v) (log q(v) - log pi(v))`` over
    the teacher's top-k tokens K, both log-probs clamped below at ``log_prob_min_clamp`` when set, the result
    clamped at 0 (the truncated sums can go negative). With k = V it is the full forward ``KL(q || pi)``.

    ``student_topk_log_probs`` and ``teacher_topk_log_probs`` (B, T, k): log pi and log q of the teacher's top-k
    tokens. Returns (B, T)."""
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    return (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)


def topk_losses(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                teacher_topk_ids: torch.Tensor, student_topk_ids: torch.Tensor, response_mask: torch.Tensor,
                params: DistillationParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(``forward_kl_topk``'s per-token losses (B, T); verl's top-k metrics over the valid tokens):
    ``distillation/student_mass`` and ``teacher_mass`` (the probability each puts on the teacher's top k; with
    ``_min`` / ``_max``), ``overlap_ratio`` (the share of the teacher's top k also in the student's top k) and
    ``overlap_token_advantage`` (mean over positions with an overlap of ``-sum_{v in overlap} q(v)(log q(v) -
    log pi(v)) / |overlap|``; Rethinking On-Policy Distillation, arXiv:2604.13016, as verl logs it)."""
    valid = response_mask.bool()
    losses = forward_kl_topk(student_topk_log_probs, teacher_topk_log_probs,
                             log_prob_min_clamp=params.log_prob_min_clamp)
    with torch.no_grad():
        s, t = student_topk_log_probs.detach().float(), teacher_topk_log_probs.float()
        s_mass, t_mass = s.exp().sum(-1)[valid], t.exp().sum(-1)[valid]
        if params.log_prob_min_clamp is not None:                # verl's overlap metrics read the clamped ones
            s, t = s.clamp_min(params.log_prob_min_clamp), t.clamp_min(params.log_prob_min_clamp)
        overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
        count = overlap.sum(-1)
        advantage = (-(t.exp() * (t - s)) * overlap).sum(-1) / count.clamp_min(1)
        has = valid & (count > 0)
        zero, k = s.new_zeros(()), teacher_topk_ids.shape[-1]
        metrics = {"distillation/student_mass": s_mass.mean() if s_mass.numel() else zero,
                   "distillation/teacher_mass": t_mass.mean() if t_mass.numel() else zero,
                   "distillation/student_mass_min": s_mass.min() if s_mass.numel() else s.new_full((), math.inf),
                   "distillation/student_mass_max": s_mass.max() if s_mass.numel() else s.new_full((), -math.inf),
                   "distillation/teacher_mass_min": t_mass.min() if t_mass.numel() else s.new_full((), math.inf),
                   "distillation/teacher_mass_max": t_mass.max() if t_mass.numel() else s.new_full((), -math.inf),
                   "distillation/overlap_ratio": count[valid].float().mean() / k if valid.any() else zero,
                   "distillation/overlap_token_advantage": advantage[has].mean() if has.any() else zero}
    return losses, metrics
