"""A tiny DeepSeek-V3, GLM-4.5 and HY-V3 checkpoint each train for two GRPO steps on lathe's decoder and engine, with
routing replay R3 (the engine records their group-limited choices, the trainer's forwards replay them); the checkpoint
each saves reads back into transformers' class with every tensor (the per-expert names, the selection bias)."""

import pytest
import torch

from .test_ppo import reads_back, save_with_builtin_tokenizer, steps_from


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "hy_v3"])
def test_two_steps_with_a_deepseek_style_checkpoint(tmp_path, family):
    from transformers import DeepseekV3ForCausalLM, Glm4MoeForCausalLM, HYV3ForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.deepseek import DeepseekMoeBlock

    from models.deepseek_tiny import deepseek_model
    from models.glm_tiny import glm_model
    from models.hy_tiny import hy_model
    tok = builtin_tokenizer()
    build, hf_class = {"deepseek_v3": (deepseek_model, DeepseekV3ForCausalLM),
                       "glm4_moe": (glm_model, Glm4MoeForCausalLM), "hy_v3": (hy_model, HYV3ForCausalLM)}[family]
    model = save_with_builtin_tokenizer(build(vocab_size=len(tok), num_attention_heads=2, num_key_value_heads=2,
                                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                                        tmp_path / "model")
    trainer, metrics = steps_from(tmp_path, model, "actor_rollout_ref.actor.router_replay.mode=R3",
                                  "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert any(isinstance(m, DeepseekMoeBlock) for m in trainer.worker.model.modules())
    assert trainer.worker.rollout.name == "lathe"                  # rollout.name=auto: lathe's engine runs it
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert 0 <= metrics[2]["actor/routing_replay_changed"] <= 1      # replayed: the share it overrode is reported
    assert reads_back(hf_class, tmp_path / "run")
