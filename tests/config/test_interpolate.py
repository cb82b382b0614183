"""Tests for lathe.config.interpolate: ${...} references resolved after all overrides."""

import pytest

from lathe.config import ConfigError, LatheConfig
from lathe.config.interpolate import resolve_interpolations
from lathe.config.tree import apply_layer, parse_override


def resolved(overrides):
    cfg = LatheConfig()
    apply_layer(cfg, [parse_override(o) for o in overrides], context="")
    resolve_interpolations(cfg)
    return cfg


def test_default_local_dir_uses_final_names():
    cfg = resolved(["trainer.project_name=p1", "trainer.experiment_name=e1"])
    assert cfg.trainer.default_local_dir == "checkpoints/p1/e1"


def test_whole_reference_keeps_type_and_partial_becomes_text():
    cfg = resolved(["critic.ppo_epochs=${actor_rollout_ref.actor.ppo_epochs}", "actor_rollout_ref.actor.ppo_epochs=4",
                    "trainer.experiment_name=bs${data.train_batch_size}", "critic.optim.lr=${actor_rollout_ref.actor.optim.lr}"])
    assert cfg.critic.ppo_epochs == 4
    assert cfg.trainer.experiment_name == "bs1024"
    assert cfg.critic.optim.lr == cfg.actor_rollout_ref.actor.optim.lr


def test_chained_references_and_dict_values():
    cfg = resolved(["trainer.experiment_name=${trainer.project_name}", "trainer.project_name=${data.prompt_key}",
                    "+actor_rollout_ref.model.override_config.tag=${trainer.seed}"])
    assert cfg.trainer.experiment_name == "prompt"
    assert cfg.actor_rollout_ref.model.override_config == {"tag": 42}


def test_env_and_select(monkeypatch):
    monkeypatch.setenv("LATHE_TEST_PROJECT", "from_env")
    cfg = resolved(["trainer.project_name=${oc.env:LATHE_TEST_PROJECT}", "trainer.rollout_data_dir=${oc.env:LATHE_NOPE_X,/tmp/r}",
                    "trainer.validation_data_dir=${oc.select:trainer.nope,/tmp/v}"])
    assert cfg.trainer.project_name == "from_env"
    assert cfg.trainer.rollout_data_dir == "/tmp/r"
    assert cfg.trainer.validation_data_dir == "/tmp/v"


def test_unknown_reference_names_key_and_suggests():
    with pytest.raises(ConfigError) as err:
        resolved(["trainer.default_local_dir=out/${trainer.projct_name}"])
    text = str(err.value)
    assert "trainer.default_local_dir" in text and "trainer.projct_name" in text and "`trainer.project_name`" in text


def test_cycle_and_group_reference_and_type_mismatch():
    with pytest.raises(ConfigError, match="Circular"):
        resolved(["trainer.project_name=${trainer.experiment_name}", "trainer.experiment_name=${trainer.project_name}"])
    with pytest.raises(ConfigError, match="is a group"):
        resolved(["trainer.project_name=${data}"])
    with pytest.raises(ConfigError, match=r"data.train_batch_size=lathe.*came from \$\{trainer.project_name\}"):
        resolved(["data.train_batch_size=${trainer.project_name}"])


def test_missing_env_without_default():
    with pytest.raises(ConfigError, match="LATHE_SURELY_UNSET_VAR"):
        resolved(["trainer.project_name=${oc.env:LATHE_SURELY_UNSET_VAR}"])
