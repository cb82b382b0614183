"""Fill keys left null with the value they fall back to (verl's ``${...}`` defaults, made concrete).

After ``fill_defaults`` the tree holds plain numbers everywhere downstream code looks: the critic's
mini-batch size, the rollout's prompt length, the clip bounds, ... Deprecated verl keys
(global ``*_micro_batch_size``, ``warmup_style``, ``optim.clip_grad``) are converted here too.
"""

from __future__ import annotations

import warnings

from .errors import ProblemList
from .plan import is_async
from .rules_optim import fill_schedule
from .schema import LatheConfig


def fill_defaults(cfg: LatheConfig, device_count: int, problems: ProblemList) -> None:
    """Make every fallback concrete; conversion problems are added to ``problems``."""
    _fill_actor(cfg)
    _fill_rollout_ref(cfg)
    _fill_critic(cfg)
    _fill_misc(cfg)
    _convert_micro_batches(cfg, device_count, problems)
    critic = cfg.critic
    if critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
    rm, arr = cfg.reward_model, cfg.actor_rollout_ref
    if rm.enable and rm.micro_batch_size_per_gpu is None:      # the policy's forward-only micro-batch
        rm.micro_batch_size_per_gpu = (arr.rollout.log_prob_micro_batch_size_per_gpu
                                       or arr.actor.ppo_micro_batch_size_per_gpu)


def _fill_actor(cfg: LatheConfig) -> None:
    """Clip bounds fall back to clip_ratio; old optimizer and rollout-correction spellings go to the new keys (the
    Megatron backend's optimizer name adam is torch.optim's AdamW)."""
    actor = cfg.actor_rollout_ref.actor
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    for owner in (actor, cfg.critic):
        fill_schedule(owner.optim)
        if owner.optim.clip_grad is not None:
            owner.grad_clip = owner.optim.clip_grad
        if owner.optim.optimizer == "adam" and "megatron" in (cfg.model_engine, owner.strategy):
            owner.optim.optimizer = "AdamW"          # Megatron's adam decays the weights decoupled: AdamW
    if actor.data_loader_seed is None:
        actor.data_loader_seed = cfg.trainer.seed
    rc = cfg.algorithm.rollout_correction
    if rc.use_policy_gradient:                 # verl's older spelling of loss_type=reinforce
        rc.loss_type = "reinforce"


def _fill_rollout_ref(cfg: LatheConfig) -> None:
    """Rollout lengths come from data (the engine's max_model_len from them); log-prob batching from the actor."""
    arr = cfg.actor_rollout_ref
    actor, ref, rollout = arr.actor, arr.ref, arr.rollout
    if rollout.prompt_length is None:
        rollout.prompt_length = cfg.data.max_prompt_length
    if rollout.response_length is None:
        rollout.response_length = cfg.data.max_response_length
    if rollout.max_model_len is None:
        rollout.max_model_len = rollout.prompt_length + rollout.response_length
    for owner in (ref, rollout):
        if owner.log_prob_use_dynamic_bsz is None:
            owner.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if owner.log_prob_max_token_len_per_gpu is None:
            owner.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if ref.ulysses_sequence_parallel_size is None:
        ref.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size
    if ref.use_torch_compile is None:
        ref.use_torch_compile = actor.use_torch_compile
    rc, at = cfg.algorithm.rollout_correction, cfg.async_training
    # fully async with the rollout's log-probs as PPO's old ones (no proximal pass) already takes the FP8 policy as
    # the behaviour policy: nothing to correct against, and rules refuse a correction there
    behaviour_is_rollout = is_async(cfg) and at.use_rollout_log_probs and not at.compute_prox_log_prob
    # an FP8 rollout (weights, or its KV cache) samples another policy than the bf16 trainer's, and an FP8-trained
    # actor (fsdp_config.fp8_training) computes its log-probs in another precision than the rollout samples in
    precisions_differ = bool(rollout.quantization or rollout.kv_cache_dtype != "auto" or actor.fsdp_config.fp8_training)
    if (precisions_differ and rollout.quantization_correction and rc.rollout_is is None and rc.rollout_rs is None
            and not rc.bypass_mode and not behaviour_is_rollout):
        rc.rollout_is = "token"           # (truncated at rollout_is_threshold, 2 by default: verl's token TIS)


def _fill_critic(cfg: LatheConfig) -> None:
    """Critic keys left null take the actor's / the policy model's values."""
    actor, model, critic = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, cfg.critic
    for key in ("ppo_mini_batch_size", "use_dynamic_bsz", "ppo_epochs", "shuffle", "data_loader_seed",
                "loss_agg_mode"):
        if getattr(critic, key) is None:
            setattr(critic, key, getattr(actor, key))
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    if critic.model.path is None:
        critic.model.path = model.path
    if critic.model.tokenizer_path is None:
        critic.model.tokenizer_path = model.tokenizer_path or model.path
    if critic.model.external_lib is None:
        critic.model.external_lib = model.external_lib
    if critic.model.trust_remote_code is None:
        critic.model.trust_remote_code = model.trust_remote_code


def _fill_misc(cfg: LatheConfig) -> None:
    """Data seed, DAPO generation batch and reward-model batching fallbacks; in fully-async mode a training step is
    `require_batches x ppo_mini_batch_size` prompts (verl: train_batch_size has no effect there, its scripts set 0)
    and prompts are sent to the rollout one at a time unless data.gen_batch_size says otherwise."""
    if cfg.data.seed is None:
        cfg.data.seed = cfg.trainer.seed
    if is_async(cfg):
        step = cfg.async_training.require_batches * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        if cfg.data.train_batch_size not in (0, step, LatheConfig().data.train_batch_size):
            warnings.warn(f"data.train_batch_size={cfg.data.train_batch_size} has no effect in fully-asynchronous "
                          f"training: a step is async_training.require_batches x ppo_mini_batch_size = {step} "
                          "prompts (set data.train_batch_size=0, as verl's fully-async scripts do)", stacklevel=2)
        cfg.data.train_batch_size = step
        if cfg.data.gen_batch_size is None:
            cfg.data.gen_batch_size = 1
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size
    rm = cfg.reward_model
    if rm.use_dynamic_bsz is None:
        rm.use_dynamic_bsz = cfg.critic.use_dynamic_bsz
    if rm.forward_max_token_len_per_gpu is None:
        rm.forward_max_token_len_per_gpu = cfg.critic.forward_max_token_len_per_gpu


def _micro_pairs(cfg: LatheConfig) -> list[tuple[object, str, str, str]]:
    """(owner, deprecated field, per-device field, owner's dotted path) for each verl pair."""
    arr = cfg.actor_rollout_ref
    return [
        (arr.actor, "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor"),
        (arr.ref, "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref"),
        (arr.rollout, "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
         "actor_rollout_ref.rollout"),
        (cfg.critic, "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "critic"),
        (cfg.critic, "forward_micro_batch_size", "forward_micro_batch_size_per_gpu", "critic"),
        (cfg.reward_model, "micro_batch_size", "micro_batch_size_per_gpu", "reward_model"),
    ]


def _convert_micro_batches(cfg: LatheConfig, device_count: int, problems: ProblemList) -> None:
    """verl's deprecated global micro-batch sizes become per-device sizes (global / devices)."""
    for owner, old, new, prefix in _micro_pairs(cfg):
        total, per_device = getattr(owner, old), getattr(owner, new)
        if total is None:
            continue
        if per_device is not None:
            problems.add(f"Both {prefix}.{old}={total} and {prefix}.{new}={per_device} are set. {old} is "
                         f"verl's deprecated global size; {new} replaces it. Fix: remove {prefix}.{old}.")
            continue
        if total < device_count or total % device_count:
            problems.add(f"{prefix}.{old}={total} (deprecated global micro-batch, in sequences) must be a "
                         f"positive multiple of the device count {device_count}, because it is split evenly "
                         f"across devices. Fix: set {prefix}.{new} (sequences per device) instead.")
            continue
        setattr(owner, new, total // device_count)
        setattr(owner, old, None)
        warnings.warn(f"{prefix}.{old} is deprecated (verl); using {prefix}.{new}={total // device_count} "
                      f"({total} / {device_count} devices). Set {prefix}.{new} to silence this.",
                      DeprecationWarning, stacklevel=4)
