"""PF-PPO: policy filtration for PPO (Zhang, Shen et al. 2024, "Policy Filtration for RLHF to Mitigate Noise in
Reward Models", arXiv:2409.06957); verl's ``algorithm.use_pf_ppo`` and ``algorithm.pf_ppo.{reweight_method,
weight_pow}``.

The paper finds a learned reward more reliable on some responses (those it scores highest, or at either extreme)
than on the rest, so PF-PPO trains on a batch redrawn by score, in which the trusted responses dominate. With s_i
the sequence score of row i (the sum of its token-level scores, before any KL penalty) and B rows:

    pow:        w_i = |s_i| ** weight_pow
    max_min:    w_i = 1 if s_i == max_j s_j or s_i == min_j s_j, else 0        (the best and the worst)
    max_random: w_i = 0.4 if s_i == max_j s_j, else 0.1                       (the best, then any)
    floor:      w_i <- max(w_i + 1e-8, 1e-8)                                  (every row keeps a chance)

then B row indices are drawn with replacement, row i with probability w_i / sum_j w_j (``torch.multinomial``): the
batch keeps its size, some rows come several times and others not at all. All weights zero (every score 0 under
``pow``) or all equal (``max_min`` with one distinct score) draw uniformly. verl applies it after the advantages
and returns are computed, to every field of the batch, before the critic and actor updates.
"""

from __future__ import annotations

import torch

__all__ = ["REWEIGHT_METHODS", "WEIGHT_FLOOR", "pf_ppo_weights", "pf_ppo_resample"]

REWEIGHT_METHODS = ("pow", "max_min", "max_random")
WEIGHT_FLOOR = 1e-8


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """(B,) float64 sampling weights of the rows with sequence scores ``scores`` (B,), floor included (see the module
    docstring). Raises ValueError on an unknown method or on a score or weight that is not finite."""
    if reweight_method not in REWEIGHT_METHODS:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not a PF-PPO method. "
                         f"Fix: use one of {', '.join(REWEIGHT_METHODS)}.")
    s = scores.detach().reshape(-1).to(torch.float64)
    if not torch.isfinite(s).all():
        raise ValueError(f"PF-PPO: {int((~torch.isfinite(s)).sum())} sequence score(s) are NaN or infinite, which "
                         "give no sampling weight. Fix: make the reward function return finite numbers.")
    if s.numel() == 0:
        return s
    if reweight_method == "pow":
        w = s.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        w = ((s == s.max()) | (s == s.min())).to(torch.float64)
    else:
        w = torch.full_like(s, 0.1).masked_fill(s == s.max(), 0.4)
    w = (w + WEIGHT_FLOOR).clamp(min=WEIGHT_FLOOR)
    if not torch.isfinite(w).all():
        raise ValueError(f"PF-PPO: |score| ** algorithm.pf_ppo.weight_pow={weight_pow} is not finite for some rows "
                         "(a zero score under a negative power, or an overflow). Fix: use a weight_pow >= 0 and "
                         "scores of a moderate size.")
    return w


@torch.no_grad()
def pf_ppo_resample(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) int64 row indices drawn with replacement by ``pf_ppo_weights`` (scores (B,)), from ``generator`` (a CPU
    generator; None: torch's global one). Returned sorted: the same rows as the draw, in batch order, so that the
    rows of a prompt stay together and the update's mini-batches are cut as without PF-PPO (verl keeps the draw's
    order; the order only decides which rows share a mini-batch)."""
    w = pf_ppo_weights(scores.cpu(), reweight_method, weight_pow)
    if w.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    drawn = torch.multinomial(w, w.numel(), replacement=True, generator=generator)
    return drawn.sort().values
