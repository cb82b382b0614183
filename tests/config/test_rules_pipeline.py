"""Megatron's / torchtitan's pipeline-parallel sizes run as FSDP sharding over those devices (`verl_translate`): the
stages compute the same loss and gradients as the whole model, so no lathe key is set and one notice says so."""

import warnings

import pytest

from lathe.config import run_plan
from lathe.config.explain import SAME, explain
from lathe.config.plan import MeshPlan
from lathe.config.schema import LatheConfig
from lathe.config.tree import all_paths

from .test_rules_tp import GAE, load

A, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"


def notices(*overrides: str, devices: int = 8) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(*GAE, *overrides, devices=devices)
    lines = [line for w in caught for line in str(w.message).splitlines() if "pipeline-parallel size" in line]
    return cfg, lines


@pytest.mark.parametrize("pp_key", ["megatron.pipeline_model_parallel_size", "torchtitan.pipeline_parallel_size"])
def test_pipeline_stages_become_fsdp_sharding_with_one_notice(pp_key):
    roles = (A, REF, "critic")
    cfg, found = notices(*(f"+{role}.megatron.tensor_model_parallel_size=2" for role in roles),
                         *(f"+{role}.{pp_key}=2" for role in roles))
    run = run_plan(cfg)
    assert run.mesh("actor") == MeshPlan(1, 4, 2) and run.mesh("critic") == MeshPlan(1, 4, 2)
    assert run.actor.data_parallel_size == 4          # world / TP: the stages' devices hold data of their own
    assert len(found) == 1 and all(f"{role}: PP 2" in found[0] for role in roles)
    assert "same loss and gradients" in found[0] and "a layout, not another computation" in found[0]
    assert not notices(f"+{A}.{pp_key}=1")[1]          # size 1: nothing to say


def test_virtual_stages_and_pipeline_beside_expert_parallelism():
    """As DeepSeek-V3's script: TP beside EP is dropped, PP (virtual PP) runs as FSDP sharding; each notice once."""
    cfg, found = notices(f"+{A}.megatron.tensor_model_parallel_size=2", f"+{A}.megatron.expert_model_parallel_size=4",
                         f"+{A}.megatron.pipeline_model_parallel_size=2",
                         f"+{A}.megatron.virtual_pipeline_model_parallel_size=2", devices=16)
    assert run_plan(cfg).mesh("actor") == MeshPlan(1, 16, 1, 4)
    assert len(found) == 1 and f"{A}: PP 2 and virtual PP 2" in found[0]


def test_lathe_has_no_pipeline_key_and_migrate_says_same_either_way():
    own = [p for p in all_paths(LatheConfig) if "pipeline" in p]
    assert own == ["actor_rollout_ref.rollout.pipeline_model_parallel_size"]      # verl's engine key (refused > 1)
    rows = explain([*GAE, "trainer.n_gpus_per_node=8", f"{A}.megatron.pipeline_model_parallel_size=2"]).rows
    assert rows[-1].verdict == SAME and "FSDP sharding over those devices" in rows[-1].why
