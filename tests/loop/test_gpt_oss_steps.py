"""A tiny GPT-OSS checkpoint trains for two GRPO steps on lathe's decoder and engine, with the routers' load-balancing
loss on (GPT-OSS's `output_router_logits` / `router_aux_loss_coef`, as transformers adds it); the checkpoint it saves
reads back into transformers' `GptOssForCausalLM` with every tensor."""

import pytest
import torch

from .test_ppo import reads_back, save_with_builtin_tokenizer, steps_from


@pytest.mark.parametrize("grouped", [False, True])
def test_two_steps_with_a_gpt_oss_checkpoint(tmp_path, grouped):
    """`grouped`: prefix-grouped training passes (the actor's and, with the KL loss, the reference's), the sliding
    window and sinks across each response's gathered prompt."""
    from transformers import GptOssForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.gpt_oss import GptOssMoeBlock

    from models.gpt_oss_tiny import gpt_oss_model
    tok = builtin_tokenizer()
    model = save_with_builtin_tokenizer(gpt_oss_model(vocab_size=len(tok), num_attention_heads=2,
                                                      num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                                                      pad_token_id=tok.pad_token_id), tmp_path / "model")
    trainer, metrics = steps_from(tmp_path, model, "+actor_rollout_ref.model.override_config.output_router_logits=true",
                                  "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.5",
                                  *(["actor_rollout_ref.actor.use_prefix_grouper=true",
                                     "actor_rollout_ref.actor.use_kl_loss=true"] if grouped else []))
    assert any(isinstance(m, GptOssMoeBlock) for m in trainer.worker.model.modules())
    assert trainer.worker.rollout.name == "lathe"                  # rollout.name=auto: lathe's engine runs it
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert 1.0 <= metrics[2]["actor/router_aux_loss"] < 4.0        # E * sum f P: 2 = k when balanced
    assert reads_back(GptOssForCausalLM, tmp_path / "run")
