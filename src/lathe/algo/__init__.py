"""Algorithm catalogue: pure tensor functions for advantages, losses, KL, aggregation, rollout correction,
PF-PPO's resampling.

No models, no config objects, no distribution. Importing this package registers every built-in advantage
estimator and policy loss, so ``ADV_ESTIMATORS`` / ``POLICY_LOSSES`` are complete after any import from
``lathe.algo``.
"""

from lathe.algo import advantages, bypass, gdpo, otb, policy_loss, policy_loss_cov, policy_loss_dppo  # noqa: F401
from lathe.algo.aggregate import LOSS_AGG_MODES, agg_loss, global_batch_info
from lathe.algo.dapo import filter_groups, overlong_reward_penalty
from lathe.algo.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from lathe.algo.otb import variance_proxy_metrics
from lathe.algo.pf_ppo import REWEIGHT_METHODS, pf_ppo_resample, pf_ppo_weights
from lathe.algo.policy_loss import PolicyLossParams, compute_entropy_loss, compute_value_loss
from lathe.algo.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
    register_policy_loss,
)
from lathe.algo.rollout_correction import (
    ROLLOUT_CORRECTION_KEYS,
    ROLLOUT_RS_OPTIONS,
    compute_rollout_correction,
    rollout_probs_diff,
)
from lathe.algo.utils import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "ROLLOUT_RS_OPTIONS",
    "ROLLOUT_CORRECTION_KEYS",
    "rollout_probs_diff",
    "register_adv_estimator",
    "get_adv_estimator",
    "register_policy_loss",
    "get_policy_loss",
    "agg_loss",
    "global_batch_info",
    "kl_penalty",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "PolicyLossParams",
    "compute_value_loss",
    "compute_entropy_loss",
    "compute_rollout_correction",
    "variance_proxy_metrics",
    "filter_groups",
    "overlong_reward_penalty",
    "REWEIGHT_METHODS",
    "pf_ppo_weights",
    "pf_ppo_resample",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]
