"""PF-PPO's rules (`algorithm.use_pf_ppo`, `lathe.algo.pf_ppo`): the estimator it acts with, and a weight power
that gives every response a finite weight. (`pf_ppo.reweight_method` is a Literal: `coerce` rejects other values.)"""

from __future__ import annotations

import math

from .errors import ProblemList


def check_pf_ppo(cfg, problems: ProblemList) -> None:
    algo = cfg.algorithm
    if not algo.use_pf_ppo:
        return
    if algo.adv_estimator != "gae":
        problems.add(f"algorithm.use_pf_ppo=true with algorithm.adv_estimator={algo.adv_estimator}: verl redraws the "
                     "batch by score (PF-PPO) only where it computes GAE advantages: with any other estimator its "
                     "use_pf_ppo does nothing, which lathe refuses rather than ignore. Fix: set "
                     "algorithm.adv_estimator=gae (PPO with a critic), or remove algorithm.use_pf_ppo.")
    power = algo.pf_ppo.weight_pow
    if algo.pf_ppo.reweight_method == "pow" and not (math.isfinite(power) and power >= 0):
        problems.add(f"algorithm.pf_ppo.weight_pow={power} with reweight_method=pow: a response's weight is "
                     "|score| ** weight_pow, which is infinite (or undefined) for a score of 0, as rule rewards give, "
                     "and torch cannot draw from it. Fix: use a finite weight_pow >= 0 (verl's default is 2.0; 0 "
                     "draws uniformly).")
