"""Tensor parallelism in the config (`fsdp_config.tensor_parallel_size` of the actor, reference and critic): verl's
megatron/torchtitan keys set it, each model's mesh gets a `tp` dim, mini-batches split over the data-parallel groups,
and sizes or combinations lathe cannot run are refused up front, naming the key."""

import pytest

from lathe.config import ConfigError, load_config, run_plan
from lathe.config.plan import MeshPlan
from lathe.config.sft import load_sft_config

A, REF, C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"
TP = {"actor": f"{A}.fsdp_config.tensor_parallel_size", "ref": f"{REF}.fsdp_config.tensor_parallel_size",
      "critic": f"{C}.fsdp_config.tensor_parallel_size"}
GAE = ["algorithm.adv_estimator=gae", "trainer.test_freq=-1", f"{A}.use_kl_loss=true"]


def load(*overrides: str, devices: int = 4, nodes: int = 1):
    return load_config("base", [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={devices}", *overrides])


def fails(*overrides: str, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        load(*overrides, **kw)
    return str(err.value)


@pytest.mark.parametrize("spelling", ["megatron.tensor_model_parallel_size", "torchtitan.tensor_parallel_size",
                                      "megatron.override_transformer_config.tensor_model_parallel_size"])
def test_verl_spellings_set_each_roles_size(spelling):
    cfg = load(*GAE, *(f"+{role}.{spelling}=2" for role in (A, REF, "critic")))
    assert [cfg.actor_rollout_ref.actor.fsdp_config.tensor_parallel_size,
            cfg.actor_rollout_ref.ref.fsdp_config.tensor_parallel_size,
            cfg.critic.model.fsdp_config.tensor_parallel_size] == [2, 2, 2]
    assert load(f"{A}.megatron.tensor_model_parallel_size=1").actor_rollout_ref.actor.fsdp_config \
        .tensor_parallel_size == 1


def test_each_model_gets_a_tp_dim_and_mini_batches_split_over_data_parallel_groups():
    sizes = ["data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=1",
             "critic.ppo_mini_batch_size=2"]
    with pytest.warns(UserWarning, match="ghost rows"):           # 2 sequences over 4 ranks: padded
        load(*GAE, *sizes)
    run = run_plan(load(*GAE, *sizes, f"{TP['actor']}=2", f"{A}.fsdp_config.fsdp_size=1", f"{TP['critic']}=4"))
    assert run.mesh("actor") == MeshPlan(2, 1, 2) and run.mesh("actor").describe() == \
        "HSDP: 2 replicas x 1-way shards x TP 2"
    assert run.mesh("ref") == MeshPlan(1, 4) and run.mesh("critic") == MeshPlan(1, 1, 4)
    assert (run.actor.tensor_parallel_size, run.actor.data_parallel_size, run.actor.group_size) == (2, 2, 2)
    assert run.actor.mini_batch_sequences_per_device == 1 and run.critic.mini_batch_sequences_per_device == 2
    assert run_plan(load(*GAE, f"{TP['ref']}=2")).ref_tensor_parallel_size == 2


def test_bad_sizes_are_refused_up_front_naming_the_key():
    text = fails(*GAE, f"{TP['actor']}=3", f"{TP['ref']}=0", f"{TP['critic']}=8")
    assert f"`{TP['actor']}`=3 does not divide the devices of a node (4 = trainer.nnodes=1 x " in text
    assert "Fix: set it to one of [1, 2, 4]" in text and f"`{TP['ref']}`=0 must be >= 1" in text
    assert f"`{TP['critic']}`=8 does not divide" in text
    # a group stays within a node: 2 nodes of 2 devices cannot hold a group of 4
    assert f"`{TP['actor']}`=4 does not divide the devices of a node" in fails(f"{TP['actor']}=4", devices=2, nodes=2)
    # fsdp_size counts the data-parallel ranks: 8 devices / TP 2 = 4, so 3 does not divide them
    assert "does not divide the trainer's 4 data-parallel ranks" in fails(
        f"{TP['actor']}=2", f"{A}.fsdp_config.fsdp_size=3", devices=8)


def test_megatron_tp_with_cp_runs_as_tp_x_ulysses():
    """verl's Megatron scripts for long responses set both: TP x Ulysses in one model, a mini-batch split over the
    devices / (TP x CP) blocks (`lathe.train.ulysses`); sizes whose product does not divide the devices are refused."""
    roles = (A, REF, "critic")
    with pytest.warns(UserWarning, match="context-parallel size .* runs as Ulysses"):
        cfg = load(*GAE, *(f"+{role}.megatron.{key}=2" for role in roles
                           for key in ("tensor_model_parallel_size", "context_parallel_size")), devices=8)
    plan = run_plan(cfg)
    for role in (plan.actor, plan.critic):
        assert (role.tensor_parallel_size, role.sequence_parallel_size, role.data_parallel_size) == (2, 2, 2)
    assert (plan.ref_tensor_parallel_size, plan.ref_sequence_parallel_size, plan.mesh("ref").dp_shard) == (2, 2, 4)
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.critic.model.use_remove_padding   # CP packs
    text = fails(*GAE, f"{TP['actor']}=2", f"{A}.ulysses_sequence_parallel_size=4",
                 "actor_rollout_ref.model.use_remove_padding=true")
    assert f"{TP['actor']}=2 with {A}.ulysses_sequence_parallel_size=4: a tensor-parallel group's 2" in text
    assert "blocks of 8 devices" in text and "whose product divides 4" in text


def test_lora_with_tensor_parallelism_loads():
    """verl's Megatron LoRA scripts set tensor_model_parallel_size beside lora_rank: the adapters are cut beside their
    projections (`lathe.train.tensor_parallel`), the reference is the actor with them off; Ulysses beside both too."""
    cfg = load(f"+{A}.megatron.tensor_model_parallel_size=2", f"{TP['ref']}=2", "actor_rollout_ref.model.lora_rank=32",
               "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.model.target_modules=all-linear")
    run = run_plan(cfg)
    assert cfg.actor_rollout_ref.model.lora_rank == 32 and run.mesh("actor").tp == 2
    assert (run.actor.tensor_parallel_size, run.actor.data_parallel_size) == (2, 2)
    # the reference is the actor's model with its adapters off: the actor's groups, whatever its own size (1 here)
    run = run_plan(load(*GAE, f"{TP['actor']}=2", "actor_rollout_ref.model.lora_rank=8"))
    assert run.needs_ref and run.ref_tensor_parallel_size == 2 and run.mesh("ref").tp == 2
    text = fails(*GAE, f"{TP['actor']}=2", f"{TP['ref']}=4", "actor_rollout_ref.model.lora_rank=8")
    assert f"{TP['ref']}=4 with actor_rollout_ref.model.lora_rank=8: under LoRA the reference" in text
    assert f"Fix: set {TP['ref']}=2 (or leave it 1)" in text
    # and with Ulysses in the same role (tests/train/test_tp_ulysses_lora_mtp.py): blocks of TP x SP devices
    run = run_plan(load(*GAE, f"{TP['actor']}=2", f"{A}.ulysses_sequence_parallel_size=2",
                        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.use_remove_padding=true"))
    assert (run.actor.tensor_parallel_size, run.actor.sequence_parallel_size, run.actor.data_parallel_size) == (2, 2, 1)


def test_combinations_not_built_yet_are_refused():
    text = fails(f"{TP['actor']}=2", "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_dropout=0.1")
    assert "LoRA dropout with tensor parallelism is not implemented yet in lathe" in text
    assert "Fix: set actor_rollout_ref.model.lora_dropout=0" in text
    load(f"{TP['actor']}=2", f"{A}.fsdp_config.expert_parallel_size=2", "actor_rollout_ref.model.lora_rank=8")
    assert "tensor parallelism for the reward model" in fails("reward_model.model.fsdp_config.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match="tensor parallelism in lathe sft"):
        load_sft_config(None, ["trainer.n_gpus_per_node=2", "model.fsdp_config.tensor_parallel_size=2"])
