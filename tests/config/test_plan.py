"""lathe.config.plan's device meshes: verl's `fsdp_config.fsdp_size` as plain FSDP or hybrid sharding (HSDP), each
model's mesh planned once, and a size that does not divide the devices refused up front, naming the key."""

import pytest

from lathe.config import ConfigError, load_config, run_plan
from lathe.config.plan import Devices, MeshPlan, mesh_plan
from lathe.config.sft import load_sft_config, sft_mesh

A, REF, C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"
FOUR = ["trainer.device=cpu", "trainer.n_gpus_per_node=4", "data.train_batch_size=8", f"{A}.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4"]


def plan(*overrides: str):
    return run_plan(load_config("base", [*FOUR, *overrides], device_count=None))


@pytest.mark.parametrize("size, mesh", [(-1, (1, 4)), (4, (1, 4)), (8, (1, 4)), (2, (2, 2)), (1, (4, 1))])
def test_fsdp_size_is_plain_fsdp_from_the_device_count_up_and_hsdp_below(size, mesh):
    got = mesh_plan(size, Devices(4, "4 devices"), f"{A}.fsdp_config.fsdp_size")
    assert (got.dp_replicate, got.dp_shard) == mesh and got.world == 4
    assert got.hsdp == (mesh[0] > 1)


def test_each_model_gets_the_mesh_of_its_own_fsdp_size():
    run = plan("algorithm.adv_estimator=gae", f"{A}.use_kl_loss=true", f"{A}.fsdp_config.fsdp_size=2",
               f"{C}.fsdp_config.fsdp_size=1")
    assert run.mesh("actor") == MeshPlan(2, 2) and run.mesh("actor").describe() == "HSDP: 2 replicas x 2-way shards"
    assert run.mesh("ref") == MeshPlan(1, 4) and run.mesh("critic") == MeshPlan(4, 1)
    assert run.actor.device_count == 4          # the batch is cut over every rank either way
    plain = plan("algorithm.adv_estimator=grpo")
    assert set(plain.meshes) == {"actor"} and plain.mesh("ref") == MeshPlan(1, 4)


def test_an_fsdp_size_that_does_not_divide_the_devices_fails_up_front_naming_each_key():
    with pytest.raises(ConfigError) as err:
        plan("algorithm.adv_estimator=gae", f"{A}.use_kl_loss=true", f"{A}.fsdp_config.fsdp_size=3",
             f"{REF}.fsdp_config.fsdp_size=3", f"{C}.fsdp_config.fsdp_size=0")
    text = str(err.value)
    for key, value in ((A, 3), (REF, 3), (C, 0)):
        assert f"`{key}.fsdp_config.fsdp_size`={value} does not divide the trainer's 4 devices" in text
    assert "trainer.n_gpus_per_node=4" in text and "Fix: set it to one of [1, 2], or to -1" in text
    # a model that is not built is not checked: no reference without a KL term
    assert plan("algorithm.adv_estimator=grpo", f"{REF}.fsdp_config.fsdp_size=3").mesh("actor") == MeshPlan(1, 4)


def test_sft_fsdp_size():
    four = ["trainer.n_gpus_per_node=4", "trainer.device=cpu", "data.train_batch_size=8"]
    assert sft_mesh(load_sft_config(None, [*four, "model.fsdp_config.fsdp_size=2"])) == MeshPlan(2, 2)
    assert sft_mesh(load_sft_config(None, four)) == MeshPlan(1, 4)
    with pytest.raises(ConfigError, match=r"`model.fsdp_config.fsdp_size`=3 does not divide the trainer's 4 devices"):
        load_sft_config(None, [*four, "model.fsdp_config.fsdp_size=3"])
