"""verl's V1 trainer keys (lathe.config.v1): the modes that run, the ones refused with their fix, the keys read only
by colocate_async."""

import warnings

import pytest

from lathe.config import ConfigError, is_colocate_async, load_config, v1_settings
from lathe.config.support import IgnoredKeysWarning

MODE = "trainer.v1.trainer_mode"


def _load(*overrides: str):
    return load_config("default", list(overrides))


def test_defaults_and_the_legacy_trainer_run_the_synchronous_loop():
    assert v1_settings(_load()).mode == "sync" and not is_colocate_async(_load())
    cfg = _load(f"{MODE}=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=2",
                "trainer.v1.sampler.max_off_policy_threshold=3", "trainer.v1.sampler.max_off_policy_strategy=wait")
    s = v1_settings(cfg)
    assert is_colocate_async(cfg) and (s.num_warmup_batches, s.max_off_policy_threshold,
                                       s.max_off_policy_strategy) == (2, 3, "wait")
    with pytest.warns(IgnoredKeysWarning, match="use_v1=false runs verl's legacy trainer"):
        legacy = _load("trainer.use_v1=false", f"{MODE}=colocate_async")
    assert v1_settings(legacy).mode == "sync"


def test_separate_async_is_refused_with_the_fully_async_keys_that_run_it():
    with pytest.raises(ConfigError) as e:
        _load(f"{MODE}=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
              "trainer.v1.separate_async.num_warmup_batches=3")
    for part in ("rollout.n_gpus_per_node", "trigger_parameter_sync_step=2", "staleness_threshold=3",
                 "require_batches=1", "scale trainer.total_training_steps"):
        assert part in str(e.value), part
    with pytest.raises(ConfigError, match="not one of verl's modes"):
        _load(f"{MODE}=hybrid")


@pytest.mark.parametrize("key,value", [("algorithm.filter_groups.enable", "true"),
                                        ("actor_rollout_ref.rollout.multi_turn.enable", "true"),
                                        ("actor_rollout_ref.rollout.tensor_model_parallel_size", "2"),
                                        ("reward_model.launch_reward_fn_async", "true")])
def test_colocate_async_names_what_it_does_not_run_beside(key, value):
    with pytest.raises(ConfigError, match=f"colocate_async with {key}=.*Fix: train with {MODE}=sync, or remove {key}"):
        _load(f"{MODE}=colocate_async", f"{key}={value}", "trainer.n_gpus_per_node=2")


def test_keys_read_only_by_colocate_async_warn_elsewhere_and_are_checked_there():
    with pytest.warns(IgnoredKeysWarning, match="num_warmup_batches`=2 has no effect"):
        _load("trainer.v1.colocate_async.num_warmup_batches=2")
    for key, bad in (("colocate_async.num_warmup_batches", "-1"), ("sampler.max_off_policy_threshold", "0"),
                     ("sampler.max_off_policy_strategy", "evict")):
        with pytest.raises(ConfigError, match=f"trainer.v1.{key}`=.* must be"):
            _load(f"{MODE}=colocate_async", f"trainer.v1.{key}={bad}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)      # at their defaults: silent
        _load(f"{MODE}=colocate_async", "trainer.v1.sampler.max_off_policy_threshold=8")


def test_a_custom_replay_buffer_is_refused_and_failed_group_refills_have_no_effect():
    with pytest.raises(ConfigError, match="custom replay buffer"):
        _load("trainer.v1.sampler.custom_sampler.path=my_sampler.py", "trainer.v1.sampler.custom_sampler.name=B")
    with pytest.raises(ConfigError, match="custom replay buffer's arguments"):
        _load("trainer.v1.sampler.sampler_kwargs.k=1")
    with pytest.warns(IgnoredKeysWarning, match="no failed groups"):
        _load("trainer.v1.sampler.sync_refill_failed_groups=true")
