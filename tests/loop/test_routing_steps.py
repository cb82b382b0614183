"""Routing replay end to end: a tiny Qwen3-MoE trains two GRPO steps with `actor.router_replay.mode` R3 (the engine
records, the old-log-prob and update forwards replay) and R2 (the old-log-prob forward records, the update replays),
every trainer forward replaying a full batch of routing; `training/rollout_probs_diff_*` is reported either way, and
`actor/routing_replay_changed` says how much routing replay overrode. Beside `use_prefix_grouper` too (R3 and R2:
the grouped passes replay and record in their stream's order), and in the agent loop's multi-turn batches."""

import pytest
import torch

from lathe.train import routing

from .test_ppo import qwen3_moe_checkpoint, steps_from


@pytest.fixture
def replayed(monkeypatch) -> list:
    """The routing each trainer forward replays (`routing.replay_routing`'s `given`), in call order."""
    calls = []
    real = routing.replay_routing

    def spy(model, given, *args):
        calls.append(given)
        return real(model, given, *args)
    monkeypatch.setattr(routing, "replay_routing", spy)
    return calls


@pytest.mark.parametrize("mode, grouped", [("R3", False), ("R2", False), ("R3", True), ("R2", True)])
def test_two_steps_replay_the_routing(tmp_path, replayed, mode, grouped):
    model = qwen3_moe_checkpoint(tmp_path / "model")
    replay = [f"actor_rollout_ref.actor.router_replay.mode={mode}"]
    if mode == "R3":
        replay.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    if grouped:
        replay.append("actor_rollout_ref.actor.use_prefix_grouper=true")
    trainer, metrics = steps_from(tmp_path, model, "actor_rollout_ref.actor.ppo_epochs=2",
                                  "actor_rollout_ref.actor.use_dynamic_bsz=true", *replay)
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert "training/rollout_probs_diff_mean" in metrics[2]
    assert 0 <= metrics[2]["actor/routing_replay_changed"] < 0.5
    assert replayed and all(g.dim() == 3 and g.shape[1:] == (1, 2) for g in replayed)
    # the packed forwards replay a choice for every real token but each response's last (R3: never fed)
    assert all((g >= 0).float().mean() > 0.8 for g in replayed)


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_the_agent_loop_s_multi_turn_batches_replay_the_routing(tmp_path, replayed, mode):
    """The agent demo's multi-turn rollouts on a tiny Qwen3-MoE, two epochs: R3 replays what the engine recorded over
    the turns (`lathe.rollout.agent.loop.trajectory_routing`; its coverage is checked in tests/rollout/agent/
    test_loop.py), R2 what the old-log-prob forward recorded."""
    from lathe.cli import main

    from agent_task import agent_task, metric
    model = qwen3_moe_checkpoint(tmp_path / "model")
    replay = [f"actor_rollout_ref.actor.router_replay.mode={mode}"]
    if mode == "R3":
        replay.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    small = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.rollout.n=4", "data.max_response_length=48"]
    assert main(["train", *agent_task(), f"actor_rollout_ref.model.path={model}", *small,
                 "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                 f"trainer.default_local_dir={tmp_path / 'run'}", "actor_rollout_ref.actor.ppo_epochs=2",
                 "actor_rollout_ref.actor.use_dynamic_bsz=true", *replay]) == 0
    assert metric(tmp_path / "run", "num_turns/max")[-1] >= 2
    assert metric(tmp_path / "run", "training/old_log_prob_forward") == [1.0]
    assert all(0 <= x < 0.5 for x in metric(tmp_path / "run", "actor/routing_replay_changed"))
    # (the demo's forwards run padded: a choice at each real token, R3's never-fed last ones excepted; none at padding)
    assert replayed and all((g >= 0).any() for g in replayed)
