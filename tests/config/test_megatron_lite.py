"""verl's Megatron Lite backend (`megatron_lite`): its config-group selection and `engine` group translate as
Megatron's keys do (`verl_translate`, `verl_keys.MLITE_ENGINE`); what lathe has no equivalent for is named."""

import warnings

import pytest

from lathe.config import run_plan
from lathe.config.errors import ConfigError

from .test_rules_tp import fails, load

A, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
SELECT = f"actor@{A}=mlite_actor"


def test_the_engine_group_translates_as_megatrons_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(SELECT, f"{A}.engine.tp=1", f"{A}.engine.pp=2", f"{A}.engine.ep=4", f"{A}.engine.cp=2",
                   f"{A}.engine.etp=1", f"{A}.engine.param_offload=True", f"{A}.engine.optimizer_offload=True",
                   f"{A}.engine.grad_offload=True", f"{A}.engine.attention_backend_override=flash",
                   f"{A}.engine.impl_cfg.use_thd=True", f"+{A}.engine.impl_cfg.optimizer=fsdp2",
                   f"+{A}.engine.impl_cfg.recompute=[full]", f"+{REF}.engine.impl_cfg.recompute=[full]",
                   "actor_rollout_ref.model.use_remove_padding=false", devices=8)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron_lite"
    assert (actor.fsdp_config.expert_parallel_size, actor.ulysses_sequence_parallel_size) == (4, 2)
    assert actor.fsdp_config.param_offload and actor.fsdp_config.optimizer_offload
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    assert cfg.actor_rollout_ref.model.use_remove_padding          # context parallelism runs as Ulysses, packed
    assert run_plan(cfg).actor.data_parallel_size == 4               # 8 devices / Ulysses 2
    text = "\n".join(str(w.message) for w in caught)
    assert "megatron_lite runs on lathe's FSDP2 trainer" in text
    assert f"{A}: PP 2" in text                                      # pipeline stages: FSDP sharding, one notice
    for key in ("engine.grad_offload", "engine.attention_backend_override", "engine.impl_cfg.optimizer"):
        assert f"{A}.{key}" in text


def test_what_has_no_equivalent_is_refused_and_other_group_selections_stay_refused():
    assert "expert tensor parallelism" in fails(SELECT, f"{A}.engine.etp=2", f"{A}.engine.ep=2")
    with pytest.raises(ConfigError, match="Hydra config-group selection"):
        load(f"actor@{A}=my_actor")
    with pytest.raises(ConfigError, match="Hydra config-group selection"):
        load("rollout@actor_rollout_ref.rollout=mlite_rollout")
