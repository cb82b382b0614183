"""Routing replay end to end: a tiny Qwen3-MoE trains two GRPO steps with `actor.router_replay.mode` R3 (the engine
records, the old-log-prob and update forwards replay) and R2 (the old-log-prob forward records, the update replays),
every trainer forward replaying a full batch of routing; `training/rollout_probs_diff_*` is reported either way, and
`actor/routing_replay_changed` says how much routing replay overrode."""

import pytest
import torch

from lathe.train import routing

from .test_ppo import read_metrics, run


def _moe_checkpoint(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_two_steps_replay_the_routing(tmp_path, monkeypatch, mode):
    _moe_checkpoint(tmp_path / "model")
    replayed = []
    real = routing.replay_routing

    def spy(model, given, *args):
        replayed.append(given)
        return real(model, given, *args)
    monkeypatch.setattr(routing, "replay_routing", spy)
    replay = [f"actor_rollout_ref.actor.router_replay.mode={mode}"]
    if mode == "R3":
        replay.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'model'}",
                  "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
                  "trainer.test_freq=-1", "trainer.val_before_train=false", "actor_rollout_ref.actor.ppo_epochs=2",
                  "actor_rollout_ref.actor.use_dynamic_bsz=true", *replay)
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert "training/rollout_probs_diff_mean" in metrics[2]
    assert 0 <= metrics[2]["actor/routing_replay_changed"] < 0.5
    assert replayed and all(g.dim() == 3 and g.shape[1:] == (1, 2) for g in replayed)
    # the packed forwards replay a choice for every real token but each response's last (R3: never fed)
    assert all((g >= 0).float().mean() > 0.8 for g in replayed)
