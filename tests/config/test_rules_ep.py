"""Expert parallelism in the config (`fsdp_config.expert_parallel_size` of the actor, reference and critic): verl's
megatron/torchtitan/veomni keys set it, each model's mesh gets an `ep` split of its shard dim, and sizes or
combinations lathe cannot run are refused up front, naming the key."""

import pytest

from lathe.config import run_plan
from lathe.config.plan import MeshPlan
from lathe.config.tree import get_path

from .test_rules_tp import GAE, fails, load

A, REF, C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"
EP = {"actor": f"{A}.fsdp_config.expert_parallel_size", "ref": f"{REF}.fsdp_config.expert_parallel_size",
      "critic": f"{C}.fsdp_config.expert_parallel_size"}


@pytest.mark.parametrize("spelling", ["megatron.expert_model_parallel_size", "torchtitan.expert_parallel_size",
                                      "veomni.expert_parallel_size"])
def test_verl_spellings_set_each_roles_size(spelling):
    cfg = load(*GAE, *(f"+{role}.{spelling}=2" for role in (A, REF, "critic")))
    assert {role: get_path(cfg, key) for role, key in EP.items()} == dict.fromkeys(EP, 2)


def test_each_model_gets_an_ep_split_of_its_shard_dim():
    run = run_plan(load(*GAE, f"{EP['actor']}=2", f"{A}.fsdp_config.fsdp_size=2", f"{EP['critic']}=4"))
    assert run.mesh("actor") == MeshPlan(2, 2, 1, 2) and run.mesh("actor").describe() == \
        "HSDP: 2 replicas x 2-way shards, EP 2"
    assert run.mesh("ref") == MeshPlan(1, 4) and run.mesh("critic") == MeshPlan(1, 4, 1, 4)
    assert run.actor.data_parallel_size == 4          # every rank keeps data of its own


def test_bad_sizes_and_combinations_are_refused_up_front_naming_the_key():
    text = fails(*GAE, f"{EP['actor']}=3", f"{EP['ref']}=0", f"{EP['critic']}=2", f"{C}.fsdp_config.fsdp_size=1")
    assert f"`{EP['actor']}`=3 does not divide the FSDP shard group of 4 device(s)" in text
    assert "Fix: set it to one of [1, 2, 4]" in text and f"`{EP['ref']}`=0 must be >= 1" in text
    assert f"`{EP['critic']}`=2 does not divide the FSDP shard group of 1 device(s)" in text
    # TP x EP composes with Ulysses and LoRA (tests/train/test_tp_expert_parallel.py)
    run = run_plan(load(f"{EP['actor']}=4", f"{A}.fsdp_config.tensor_parallel_size=2",
                        f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
                        "actor_rollout_ref.model.lora_rank=4"))
    assert run.mesh("actor") == MeshPlan(1, 2, 2, 4) and run.actor.data_parallel_size == 1
    load(f"{EP['actor']}=2", f"{EP['ref']}=2", "actor_rollout_ref.model.lora_rank=4")
    run = run_plan(load(f"{EP['actor']}=2", f"{A}.ulysses_sequence_parallel_size=2",
                        "actor_rollout_ref.model.use_remove_padding=true"))
    assert run.mesh("actor") == MeshPlan(1, 4, 1, 2) and run.actor.data_parallel_size == 2
    # beside TP: a multiple of it that the shard group takes whole groups of, or refused naming the sizes that fit
    text = fails(f"{EP['actor']}=3", f"{A}.fsdp_config.tensor_parallel_size=2", devices=8)
    assert f"{EP['actor']}=3 with {A}.fsdp_config.tensor_parallel_size=2" in text and "a multiple or a divisor" in text
    run = run_plan(load(f"{EP['actor']}=2", f"{A}.fsdp_config.tensor_parallel_size=4", devices=8))
    assert run.mesh("actor").describe() == "FSDP: 2-way shards x TP 4, EP 2 (2 groups in each)"
    text = fails(f"{EP['actor']}=6", f"{A}.fsdp_config.tensor_parallel_size=2", devices=8)
    assert f"`{EP['actor']}`=6 over tensor-parallel groups of 2" in text and "one of [2, 4, 8]" in text
    assert "expert parallelism for the reward model" in fails("reward_model.model.fsdp_config.expert_parallel_size=2",
                                                              "reward_model.enable=true")


def test_expert_parallel_models_run_eager():
    from lathe.train.actor import use_torch_compile
    cfg = load(f"{EP['actor']}=2")
    assert not use_torch_compile(cfg.actor_rollout_ref.actor) and use_torch_compile(cfg.actor_rollout_ref.ref)


def test_weights_kept_gathered_with_offloaded_weights_are_refused():
    from lathe.config import ConfigError, load_config
    for key in ("param_offload", "offload_policy"):
        with pytest.raises(ConfigError, match=rf"keep_gathered=true with actor_rollout_ref.actor.fsdp_config.{key}"):
            load_config("base", ["actor_rollout_ref.actor.fsdp_config.keep_gathered=true",
                                 f"actor_rollout_ref.actor.fsdp_config.{key}=true"])
    load_config("base", ["actor_rollout_ref.actor.fsdp_config.param_offload=true"])     # auto: off, no problem


@pytest.mark.parametrize("tp_key", ["megatron.tensor_model_parallel_size", "torchtitan.tensor_parallel_size",
                                    "megatron.override_transformer_config.tensor_model_parallel_size"])
def test_megatron_tp_beside_ep_becomes_fsdp_sharding_with_one_notice(tp_key):
    """Megatron cuts the dense layers over TP and the experts over DP x TP: lathe shards the dense layers with FSDP over
    those devices instead; TP without EP stays TP, and lathe's own TP key keeps TP x EP (EP a multiple of TP)."""
    import warnings
    roles = (A, REF)
    ep = [f"+{role}.megatron.expert_model_parallel_size=4" for role in roles]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(*GAE, *ep, *(f"+{role}.{tp_key}=2" for role in roles), devices=8)
    run = run_plan(cfg)
    assert run.mesh("actor") == MeshPlan(1, 8, 1, 4) and run.mesh("ref") == MeshPlan(1, 8, 1, 4)
    assert run.actor.data_parallel_size == 8                 # the mini-batch is split over every device
    notices = [line for w in caught for line in str(w.message).splitlines() if "beside expert parallelism" in line]
    assert len(notices) == 1 and f"{A}: TP 2 beside EP 4" in notices[0] and f"{REF}: TP 2 beside EP 4" in notices[0]
    assert run_plan(load(f"+{A}.{tp_key}=2", devices=8)).mesh("actor").tp == 2        # no EP: TP as before
    assert "set lathe's fsdp_config.tensor_parallel_size" in notices[0]
    run = run_plan(load(*ep[:1], f"{A}.fsdp_config.tensor_parallel_size=2", devices=8))
    assert run.mesh("actor") == MeshPlan(1, 4, 2, 4) and run.actor.data_parallel_size == 4
    assert run.mesh("actor").describe() == "FSDP: 4-way shards x TP 2, EP 4 (over 2 tensor-parallel groups)"


def test_megatron_lora_beside_ep_loads_with_one_notice_that_the_routed_experts_stay_frozen():
    """verl's Megatron LoRA adapts each routed expert's linear_fc1/fc2 too; lathe's adapts the linear layers only
    (the experts are grouped weights, cut over the EP ranks and frozen): the run loads, and says so once."""
    import warnings
    ep = [f"+{role}.megatron.expert_model_parallel_size=2" for role in (A, REF)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(*ep, "+actor_rollout_ref.model.lora.rank=8", "+actor_rollout_ref.model.lora.alpha=16")
    assert cfg.actor_rollout_ref.model.lora_rank == 8 and cfg.actor_rollout_ref.actor.fsdp_config.\
        expert_parallel_size == 2
    notices = [line for w in caught for line in str(w.message).splitlines() if "routed expert" in line]
    assert len(notices) == 1 and "lora.rank=8 beside expert parallelism" in notices[0]
    assert "leaves the routed experts frozen" in notices[0]
