"""Tests for lathe.config.tree: paths, unknown-key suggestions, aliases, dict fields, to_dict/to_yaml."""

import pytest

from lathe.config import ConfigError, LatheConfig, to_dict, to_yaml
from lathe.config.coerce import load_yaml
from lathe.config.help import help_for
from lathe.config.tree import all_paths, apply_layer, flatten_mapping, get_path, parse_override


def apply(overrides, cfg=None):
    cfg = cfg or LatheConfig()
    apply_layer(cfg, [parse_override(o) for o in overrides], context="")
    return cfg


def test_nested_typo_suggests_full_path():
    with pytest.raises(ConfigError) as err:
        apply(["algorithm.adv_estimatr=grpo"])
    assert "did you mean `algorithm.adv_estimator`" in str(err.value).lower()


def test_top_level_typo_suggests_corrected_path():
    with pytest.raises(ConfigError, match=r"Did you mean `algorithm.adv_estimator`\?"):
        apply(["algoritm.adv_estimator=grpo"])


def test_key_in_wrong_group_suggests_where_it_lives():
    with pytest.raises(ConfigError) as err:
        apply(["trainer.ppo_mini_batch_size=8"])
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in str(err.value)


def test_all_bad_keys_of_a_layer_reported_together():
    with pytest.raises(ConfigError) as err:
        apply(["data.train_batch_siz=8", "trainer.seed=x", "data.shuffle=true"])
    text = str(err.value)
    assert "2 config problems" in text and "data.train_batch_siz" in text and "trainer.seed=x" in text


def test_hydra_prefixes_tolerated_and_values_parsed():
    cfg = apply(["+trainer.logger=[console,wandb]", "++actor_rollout_ref.actor.optim.lr=1e-6",
                 "trainer.total_training_steps=null", "actor_rollout_ref.rollout.top_k=5"])
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.trainer.total_training_steps is None
    assert cfg.actor_rollout_ref.rollout.top_k == 5


def test_logger_accepts_single_string():
    assert apply(["trainer.logger=wandb"]).trainer.logger == ["wandb"]


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("trainer.seed")
    with pytest.raises(ConfigError, match="null"):
        parse_override("~trainer.seed")


def test_free_dict_fields_take_new_subkeys():
    cfg = apply(["+actor_rollout_ref.model.override_config.attention_dropout=0.",
                 "ray_kwargs.ray_init.num_cpus=4", "+reward_model.reward_kwargs.max_resp_len=2048"])
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    assert cfg.ray_kwargs == {"ray_init": {"num_cpus": 4}}
    assert cfg.reward_model.reward_kwargs == {"max_resp_len": 2048}


def test_group_and_leaf_misuse_explained():
    with pytest.raises(ConfigError, match="group of settings"):
        apply(["data=3"])
    with pytest.raises(ConfigError, match="not a group"):
        apply(["data.train_batch_size.x=3"])


def test_old_custom_reward_function_alias_maps_to_reward_group():
    cfg = apply(["custom_reward_function.path=my.py", "custom_reward_function.name=score"])
    assert cfg.reward.custom_reward_function.path == "my.py"
    assert cfg.custom_reward_function.name == "score"  # read-only alias property


def test_alias_and_new_spelling_conflict_in_one_layer():
    with pytest.raises(ConfigError) as err:
        apply(["custom_reward_function.path=a.py", "reward.custom_reward_function.path=b.py"])
    assert "custom_reward_function.path" in str(err.value) and "a.py" in str(err.value)
    cfg = apply(["custom_reward_function.path=a.py", "reward.custom_reward_function.path=a.py"])
    assert cfg.reward.custom_reward_function.path == "a.py"


def test_dapo_overlong_buffer_old_spelling():
    cfg = apply(["custom_reward_function.overlong_buffer.enable=true", "custom_reward_function.overlong_buffer.len=512"])
    assert cfg.reward_model.overlong_buffer.enable is True and cfg.reward_model.overlong_buffer.len == 512


def test_flatten_mapping_descends_groups_keeps_dicts_and_skips_target():
    items = flatten_mapping({"actor_rollout_ref": {"model": {"override_config": {"a": 1}, "_target_": "x"}},
                             "custom_reward_function": {"path": "p.py"}}, "test")
    assert [(i.path, i.value) for i in items] == [("actor_rollout_ref.model.override_config", {"a": 1}),
                                                 ("custom_reward_function.path", "p.py")]


def test_yaml_group_mapping_and_dict_merge():
    cfg = LatheConfig()
    apply_layer(cfg, flatten_mapping(load_yaml("ray_kwargs: {ray_init: {num_cpus: 2}}\n"
                                               "data: {train_batch_size: 64}\n"), "t"), "")
    apply_layer(cfg, flatten_mapping({"ray_kwargs": {"timeline_json_file": "t.json"}}, "t"), "")
    assert cfg.data.train_batch_size == 64
    assert cfg.ray_kwargs == {"ray_init": {"num_cpus": 2}, "timeline_json_file": "t.json"}


def test_get_path_and_help_and_paths():
    cfg = apply(["trainer.seed=7"])
    assert get_path(cfg, "trainer.seed") == 7
    with pytest.raises(KeyError):
        get_path(cfg, "trainer.nope")
    assert "prompts" in help_for("data.train_batch_size").lower()
    assert help_for("data.nope") == ""
    paths = set(all_paths())
    assert {"algorithm.rollout_correction.rollout_is", "actor_rollout_ref.rollout.val_kwargs.n"} <= paths


def test_to_dict_and_to_yaml_mirror_the_tree():
    cfg = apply(["data.train_batch_size=64", "trainer.experiment_name=1e-3"])
    d = to_dict(cfg)
    assert d["data"]["train_batch_size"] == 64
    assert d["trainer"]["experiment_name"] == "1e-3"
    assert load_yaml(to_yaml(cfg)) == d


def test_a_group_set_by_a_verl_preset_name_takes_its_values_and_later_keys_on_top():
    cfg = apply(["algorithm.rollout_correction.rollout_is_batch_normalize=true",
                 "algorithm.rollout_correction=decoupled_geo_rs_seq_tis",
                 "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold) == (
        "sequence", 3.0, "seq_mean_k1", "0.999_1.001")
    assert rc.rollout_is_batch_normalize is False and rc.bypass_mode is False     # reset by the preset
    rc = apply(["algorithm.rollout_correction=bypass_pg_geo_rs"]).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, rc.bypass_mode, rc.loss_type) == (None, "seq_mean_k1", True, "reinforce")
    cfg = LatheConfig()
    apply_layer(cfg, flatten_mapping({"algorithm": {"rollout_correction": "decoupled_k3_rs"}}, "in test.yaml"), "")
    assert (cfg.algorithm.rollout_correction.rollout_rs, cfg.algorithm.rollout_correction.rollout_rs_threshold) == (
        "seq_mean_k3", 0.01)


def test_the_fully_async_scripts_preset_spelling_maps_to_its_verl_preset_and_a_typo_lists_them():
    with pytest.warns(UserWarning, match="taken as verl's preset decoupled_geo_rs_seq_tis"):
        rc = apply(["algorithm.rollout_correction=sequence_tis_geometric_rs"]).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs) == ("sequence", "seq_mean_k1")
    with pytest.raises(ConfigError, match=r"Did you mean `decoupled_geo_rs_seq_tis`.*Presets: disabled, "):
        apply(["algorithm.rollout_correction=decoupled_geo_rs_seq_ti"])


def test_every_rollout_correction_preset_loads():
    from lathe.config import load_config
    from lathe.config.schema import ROLLOUT_CORRECTION_PRESETS
    for name, values in ROLLOUT_CORRECTION_PRESETS.items():
        rc = load_config("default", [f"algorithm.rollout_correction={name}"]).algorithm.rollout_correction
        assert all(getattr(rc, k) == v for k, v in values.items()), name
