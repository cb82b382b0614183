"""Routing replay's config (`actor.router_replay.mode`, `rollout.enable_rollout_routing_replay`): the modes load,
and every combination lathe does not replay in is refused up front, naming the key and the fix."""

import pytest

from lathe.config import ConfigError, load_config

GRPO = ["algorithm.adv_estimator=grpo", "trainer.test_freq=-1"]
MODE = "actor_rollout_ref.actor.router_replay.mode"
ENABLE = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
R3 = [f"{MODE}=R3", f"{ENABLE}=true"]


def fails(overrides, device_count=1):
    with pytest.raises(ConfigError) as err:
        load_config("base", GRPO + overrides, device_count=device_count)
    return str(err.value)


def test_modes_load():
    assert load_config("base", GRPO + R3).actor_rollout_ref.actor.router_replay.mode == "R3"
    cfg = load_config("base", GRPO + [f"{MODE}=R2"])
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R2"
    assert not cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay


@pytest.mark.parametrize("overrides, needle", [
    ([f"{MODE}=R3"], f"{ENABLE}=false does not record"),
    ([f"{MODE}=R2", f"{ENABLE}=true"], "conflicts with R2"),
    ([f"{ENABLE}=true"], f"but {MODE}=disabled"),
    ([f"{MODE}=R4"], MODE),
    ([*R3, "actor_rollout_ref.actor.router_replay.record_file=/tmp/r.pt"], "routing replay through files"),
    ([*R3, "actor_rollout_ref.rollout.name=hf"], "rollout.name=hf"),
    ([*R3, "actor_rollout_ref.model.impl=hf"], "model.impl=hf"),
    ([f"{MODE}=R2", "algorithm.rollout_correction.bypass_mode=true"], "bypass_mode=true"),
    ([*R3, "rollout.n_gpus_per_node=1", "rollout.nnodes=1"], "fully-async"),
])
def test_unsupported_combinations_are_refused(overrides, needle):
    assert needle in fails(overrides)


def test_replay_loads_beside_the_agent_loop_and_r3_is_refused_beside_custom_loops(tmp_path):
    """R2 and R3 in multi-turn rollouts (tests/loop/test_routing_steps.py); custom agent loops record no routing of
    their turns, so R3 is refused beside them."""
    for mode in (R3, [f"{MODE}=R2"]):
        load_config("base", GRPO + mode + ["actor_rollout_ref.rollout.multi_turn.enable=true"])
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: mine\n  _target_: my_pkg.Loop\n")
    custom = f"+actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}"
    load_config("base", GRPO + [f"{MODE}=R2", custom])
    assert f"use {MODE}=R2" in fails([*R3, custom])


def test_prefix_grouped_passes_load():
    """R2/R3 beside `use_prefix_grouper` (a grouped forward replays and records in its stream's order:
    tests/train/test_routing.py)."""
    for mode in (R3, [f"{MODE}=R2"]):
        load_config("base", GRPO + mode + ["actor_rollout_ref.actor.use_prefix_grouper=true"])


def test_sequence_parallel_and_engine_tensor_parallel_load():
    """R2/R3 beside Ulysses (each rank replays its slice: tests/train/test_routing_ulysses.py); R3 beside expert-
    parallel engine replicas: every rank records the same routing (the whole router runs on each;
    tests/engine/test_expert_parallel.py), and the replica's first rank returns it."""
    sp = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true",
          "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    for mode in (R3, [f"{MODE}=R2"]):
        cfg = load_config("base", GRPO + mode + sp, device_count=2)
        assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    ro = "actor_rollout_ref.rollout"
    cfg = load_config("base", GRPO + R3 + ["trainer.n_gpus_per_node=2", f"{ro}.tensor_model_parallel_size=2",
                                           f"{ro}.expert_parallel_size=2"], device_count=2)
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 2
