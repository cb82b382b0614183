"""verl's V1 trainer keys (`trainer.use_v1`, `trainer.v1`; lathe.config.schema_v1, support_v1, rules_v1): the modes
that run, the one refused with the fully-async keys that run it, what colocate_async does not run beside, and the
keys read only in one mode."""

import warnings

import pytest

from lathe.config import ConfigError, LatheConfig, is_colocate_async, load_config, trainer_mode
from lathe.config.rules_v1 import CLASHES, colocate_async_problems
from lathe.config.support import IgnoredKeysWarning

V1 = "trainer.v1"
MODE = f"{V1}.trainer_mode"
COLOCATE = f"{MODE}=colocate_async"


def _load(*overrides: str):
    return load_config(None, list(overrides))


def _quiet(*overrides: str):
    """Loads with no IgnoredKeysWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        return _load(*overrides)


def _refused(*overrides: str) -> str:
    """The ConfigError's text (warnings about the other keys set aside)."""
    with warnings.catch_warnings(), pytest.raises(ConfigError) as err:
        warnings.simplefilter("ignore")
        _load(*overrides)
    return str(err.value)


def _no_effect(*overrides: str) -> str:
    with pytest.warns(IgnoredKeysWarning) as record:
        _load(*overrides)
    return "\n".join(str(w.message) for w in record if issubclass(w.category, IgnoredKeysWarning))


def test_defaults_run_verls_v1_trainer_in_its_synchronous_mode():
    cfg = _quiet()
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "sync"
    assert trainer_mode(cfg) == "sync" and not is_colocate_async(cfg)
    assert trainer_mode(LatheConfig()) == "sync"


def test_colocate_async_acts_with_its_typed_settings():
    cfg = _quiet(COLOCATE, f"{V1}.colocate_async.num_warmup_batches=2", f"{V1}.sampler.max_off_policy_threshold=3",
                 f"{V1}.sampler.max_off_policy_strategy=wait")
    assert trainer_mode(cfg) == "colocate_async" and is_colocate_async(cfg)
    v1 = cfg.trainer.v1
    assert (v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold,
            v1.sampler.max_off_policy_strategy) == (2, 3, "wait")


def test_the_legacy_trainer_is_synchronous_and_reads_no_v1_key():
    assert trainer_mode(_quiet("trainer.use_v1=false")) == "sync"
    text = _no_effect("trainer.use_v1=false", COLOCATE, f"{V1}.sampler.custom_sampler.path=buffer.py")
    for key in (MODE, f"{V1}.sampler.custom_sampler.path"):      # a refused key too: nothing reads it
        assert f"`{key}`" in text
    assert text.count("it is read only with trainer.use_v1=true") == 2
    with pytest.warns(IgnoredKeysWarning, match=f"`{MODE}`=colocate_async has no effect"):
        cfg = _load("trainer.use_v1=false", COLOCATE, "algorithm.filter_groups.enable=true")
    assert trainer_mode(cfg) == "sync" and colocate_async_problems(cfg) == []


def test_separate_async_is_refused_with_the_fully_async_keys_and_the_users_values():
    text = _refused(f"{MODE}=separate_async", f"{V1}.separate_async.parameter_sync_step=2",
                    f"{V1}.separate_async.num_warmup_batches=3", "trainer.total_training_steps=100",
                    "trainer.save_freq=10", "trainer.test_freq=5")
    for part in ("verl's separate-pool V1 trainer runs in lathe as fully-asynchronous training (verl's "
                 "fully_async_policy keys)", "rollout.nnodes and rollout.n_gpus_per_node",
                 "actor_rollout_ref.rollout.nnodes / n_gpus_per_node", "async_training.trigger_parameter_sync_step=2",
                 "async_training.require_batches=1", "async_training.staleness_threshold=3",
                 f"remove {MODE}", "counts parameter_sync_step=2 of them as one step",
                 "trainer.total_training_steps=200, trainer.save_freq=20 and trainer.test_freq=10"):
        assert part in text, part
    assert "separate_async.parameter_sync_step`" not in text     # its own keys: quoted, not warned about


def test_separate_async_quotes_the_standalone_rollout_devices_given():
    text = _refused(f"{MODE}=separate_async", "actor_rollout_ref.rollout.nnodes=1",
                    "actor_rollout_ref.rollout.n_gpus_per_node=4")
    assert "rollout.nnodes=1 and rollout.n_gpus_per_node=4" in text


def test_an_unknown_mode_or_strategy_is_refused_by_its_type():
    assert "sync, colocate_async or separate_async" in _refused(f"{MODE}=hybrid")
    assert "drop or wait" in _refused(COLOCATE, f"{V1}.sampler.max_off_policy_strategy=evict")


@pytest.mark.parametrize("key,value,shown", [
    ("rollout.n_gpus_per_node", "1", "1"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", "2 actor_rollout_ref.rollout.multi_turn.enable=true", "2"),
    ("actor_rollout_ref.rollout.data_parallel_size", "2", "2"),
    ("algorithm.filter_groups.enable", "true reward_model.enable=true reward_model.model.path=rm", "true"),
    ("reward_model.launch_reward_fn_async", "true", "true"),
    ("algorithm.adv_estimator", "remax reward_model.enable=true reward_model.model.path=rm", "remax")])
def test_colocate_async_names_what_it_does_not_run_beside(key, value, shown):
    text = _refused(COLOCATE, *f"{key}={value}".split(), "trainer.n_gpus_per_node=2",
                    "actor_rollout_ref.hybrid_engine=false")
    assert (f"{COLOCATE} with {key}={shown}: colocate_async beside" in text
            and f"Fix: train with {MODE}=sync, or remove {key}." in text), text


def test_colocate_async_runs_dapos_dynamic_sampling_scored_by_rule():
    cfg = _quiet(COLOCATE, "algorithm.filter_groups.enable=true", "trainer.n_gpus_per_node=2")
    assert colocate_async_problems(cfg) == [] and cfg.algorithm.filter_groups.enable


def test_colocate_async_runs_agent_loops_but_not_on_tensor_parallel_replicas(tmp_path):
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: mine\n  _target_: my_pkg.MyLoop\n")
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    cfg = LatheConfig()
    cfg.trainer.v1.trainer_mode = "colocate_async"
    cfg.actor_rollout_ref.rollout.agent = {"agent_loop_config_path": str(loops)}
    assert colocate_async_problems(cfg) == []
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    assert [m for m in colocate_async_problems(cfg) if f"{key}=2" in m and "agent loops" in m]


def test_the_clash_list_is_one_row_per_feature():
    keys = [row[0] for row in CLASHES]
    assert len(keys) == len(set(keys)) == 6
    assert colocate_async_problems(LatheConfig()) == []


@pytest.mark.parametrize("key,bad,rule", [("colocate_async.num_warmup_batches", "-1", "must be >= 0"),
                                          ("sampler.max_off_policy_threshold", "0", "must be > 0")])
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_counts_out_of_range_are_refused_in_any_mode(key, bad, rule, mode):
    text = _refused(f"{MODE}={mode}", f"{V1}.{key}={bad}")
    assert f"{V1}.{key}={bad} is out of range" in text and rule in text


@pytest.mark.parametrize("key,value", [("colocate_async.num_warmup_batches", "2"),
                                       ("sampler.max_off_policy_threshold", "3"),
                                       ("sampler.max_off_policy_strategy", "wait")])
def test_colocate_async_keys_have_no_effect_in_the_synchronous_mode(key, value):
    text = _no_effect(f"{V1}.{key}={value}")
    assert f"`{V1}.{key}`={value} has no effect in lathe: it is read only with {COLOCATE}" in text
    if key.startswith("sampler."):
        assert "verl's synchronous sampling does not read it either" in text


def test_a_custom_replay_buffer_is_refused():
    text = _refused(f"{V1}.sampler.custom_sampler.path=my_buffer.py", f"{V1}.sampler.custom_sampler.name=Buffer",
                    f"{V1}.sampler.sampler_kwargs.capacity=4")
    for key in ("custom_sampler.path`=my_buffer.py", "custom_sampler.name`=Buffer", "sampler_kwargs`"):
        assert f"`{V1}.sampler.{key}" in text, key
    assert "custom replay buffer (verl's ReplayBuffer subclass over its TransferQueue)" in text
    assert "Fix: remove it." in text and "Fix: remove them." in text


def test_failed_group_refills_have_no_effect():
    text = _no_effect(f"{V1}.sampler.sync_refill_failed_groups=true")
    assert "lathe's rollout has no failed groups: a trajectory that fails stops the step with its error" in text


def test_separate_async_settings_have_no_effect_in_the_modes_that_run():
    text = _no_effect(COLOCATE, f"{V1}.separate_async.parameter_sync_step=8",
                      f"{V1}.separate_async.hybrid_rollout.enable_switch=true")
    for key in ("parameter_sync_step`=8", "hybrid_rollout.enable_switch`=true"):
        assert f"`{V1}.separate_async.{key} has no effect in lathe: it is read only with {MODE}=separate_async" in text


def test_verls_nested_tree_loads_its_target_dropped_and_sync_is_inert(tmp_path):
    path = tmp_path / "v1.yaml"
    path.write_text("trainer:\n  use_v1: true\n  v1:\n    trainer_mode: colocate_async\n    sync: {}\n"
                    "    separate_async:\n      hybrid_rollout:\n        _target_: verl.trainer.config."
                    "HybridRolloutSwitchConfig\n        enable_switch: false\n"
                    "    sampler:\n      custom_sampler: {path: null, name: null}\n      sampler_kwargs: {}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        cfg = load_config(path)
        _load(f"{V1}.separate_async.hybrid_rollout._target_=verl.trainer.config.HybridRolloutSwitchConfig",
              f"{V1}.sync.anything=1")
    assert is_colocate_async(cfg)
