"""Tests for the schema modules: every field documented, verl defaults kept, verl keys accepted."""

import dataclasses
import warnings

import pytest

from lathe.config import LatheConfig, load_config
from lathe.config.support import IgnoredKeysWarning
from lathe.config.coerce import hints_of


def _walk(cls, prefix=""):
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        sub = hints_of(cls)[f.name]
        if dataclasses.is_dataclass(sub):
            yield from _walk(sub, f"{prefix}{f.name}.")


def test_every_field_has_help():
    missing = [path for path, f in _walk(LatheConfig) if not f.metadata.get("help")]
    assert missing == []


def test_verl_defaults_kept():
    cfg = LatheConfig()
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (actor.ppo_mini_batch_size, actor.clip_ratio, actor.clip_ratio_c, actor.kl_loss_type) == (256, 0.2, 3.0,
                                                                                                      "low_var_kl")
    assert (actor.optim.lr, cfg.critic.optim.lr, actor.optim.betas) == (1e-6, 1e-5, [0.9, 0.999])
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.kl_ctrl.kl_coef, cfg.critic.cliprange_value) == ("gae", 0.001, 0.5)
    assert (rollout.val_kwargs.temperature, rollout.val_kwargs.do_sample, rollout.gpu_memory_utilization) == (0, False, 0.5)
    assert (cfg.data.train_batch_size, cfg.data.truncation, cfg.trainer.total_epochs) == (1024, "error", 30)


def test_instances_do_not_share_mutable_defaults():
    a, b = LatheConfig(), LatheConfig()
    a.trainer.logger.append("wandb")
    a.actor_rollout_ref.model.override_config["x"] = 1
    assert b.trainer.logger == ["console", "tensorboard"] and b.actor_rollout_ref.model.override_config == {}


def test_common_verl_script_keys_accepted():
    keys = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.enforce_eager=False", "actor_rollout_ref.rollout.free_cache_engine=True",
            "trainer.default_hdfs_dir=null", "reward_model.enable=False", "reward_model.reward_manager=dapo",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs_threshold_lower=null", "algorithm.filter_groups.metric=acc",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.actor.fsdp_config.grad_offload=False", "actor_rollout_ref.rollout.name=hf"]
    no_effect = ["data.dataloader_num_workers=4", "ray_kwargs.ray_init.num_cpus=8",
                 "actor_rollout_ref.actor.profiler.enable=true"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("base", ["algorithm.adv_estimator=grpo"] + keys)
    assert cfg.algorithm.rollout_correction.rollout_is == "token" and cfg.actor_rollout_ref.rollout.mode == "async"
    with pytest.warns(IgnoredKeysWarning, match="3 config key") as record:
        load_config("base", ["algorithm.adv_estimator=grpo"] + keys + no_effect)
    assert all(key.split("=")[0].split(".")[0] in str(record[0].message) for key in no_effect)


def test_defaults_satisfy_their_own_annotations():
    from lathe.config.coerce import coerce

    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value, path = getattr(obj, f.name), f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                yield from walk(value, path + ".")
                continue
            checked = coerce(value, hints_of(type(obj))[f.name], path, meta=dict(f.metadata))
            if type(checked) is not type(value) or checked != value:
                yield path

    assert list(walk(LatheConfig())) == []
