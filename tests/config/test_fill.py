"""Tests for lathe.config.fill: null keys take their fallback values; deprecated verl keys convert."""

import warnings

import pytest

from lathe.config import LatheConfig
from lathe.config.errors import ProblemList
from lathe.config.fill import fill_defaults
from lathe.config.tree import apply_layer, parse_override


def filled(overrides, device_count=1):
    cfg = LatheConfig()
    apply_layer(cfg, [parse_override(o) for o in overrides], context="")
    problems = ProblemList()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fill_defaults(cfg, device_count, problems)
    return cfg, problems.problems


def test_clip_bounds_fall_back_to_clip_ratio_like_verl():
    cfg, _ = filled(["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)


def test_use_policy_gradient_is_the_old_spelling_of_reinforce():
    cfg, _ = filled(["algorithm.rollout_correction.use_policy_gradient=true"])
    assert cfg.algorithm.rollout_correction.loss_type == "reinforce"
    assert filled([])[0].algorithm.rollout_correction.loss_type == "ppo_clip"


def test_critic_and_rollout_fall_back_to_actor_and_data():
    cfg, _ = filled(["actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_epochs=2",
                     "data.max_prompt_length=100", "actor_rollout_ref.model.path=m", "critic.shuffle=true"])
    assert cfg.critic.ppo_mini_batch_size == 64 and cfg.critic.ppo_epochs == 2
    assert cfg.critic.shuffle is True  # explicitly set: not overwritten
    assert cfg.critic.data_loader_seed == cfg.actor_rollout_ref.actor.data_loader_seed == cfg.trainer.seed
    assert cfg.critic.model.path == "m" and cfg.critic.model.tokenizer_path == "m"
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    assert cfg.data.seed == cfg.trainer.seed and cfg.data.gen_batch_size == cfg.data.train_batch_size


def test_engine_max_model_len_is_prompt_plus_response_length():
    cfg, _ = filled(["data.max_prompt_length=100", "actor_rollout_ref.rollout.response_length=30"])
    assert cfg.actor_rollout_ref.rollout.max_model_len == 130
    cfg, _ = filled(["data.max_prompt_length=100", "actor_rollout_ref.rollout.max_model_len=500"])
    assert cfg.actor_rollout_ref.rollout.max_model_len == 500   # explicitly set: not overwritten


def test_old_optimizer_spellings_copied():
    cfg, _ = filled(["actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.clip_grad=0.5"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr_scheduler_type == "cosine" and actor.grad_clip == 0.5


def test_deprecated_global_micro_batch_divided_by_devices():
    with pytest.warns(DeprecationWarning, match="ppo_micro_batch_size"):
        cfg = LatheConfig()
        apply_layer(cfg, [parse_override("actor_rollout_ref.actor.ppo_micro_batch_size=128")], context="")
        fill_defaults(cfg, 8, ProblemList())
    actor = cfg.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size_per_gpu == 16 and actor.ppo_micro_batch_size is None


def test_deprecated_micro_batch_conflicts_and_bad_division():
    _, problems = filled(["critic.ppo_micro_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=2"])
    assert any("critic.ppo_micro_batch_size=8" in p and "critic.ppo_micro_batch_size_per_gpu=2" in p for p in problems)
    _, problems = filled(["actor_rollout_ref.rollout.log_prob_micro_batch_size=12"], device_count=8)
    assert any("log_prob_micro_batch_size=12" in p and "8" in p for p in problems)
