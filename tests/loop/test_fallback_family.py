"""Families lathe's decoder does not implement train on the transformers fallback: a tiny DeepSeek-V4 (verl's two
DeepSeek-V4 scripts; compressed attention, hyper-connections, hash-routed MoE, and a grouped output projection that
subclasses `nn.Linear` with a forward of its own) and a tiny GLM-5 (`glm_moe_dsa`: DeepSeek sparse attention's
indexer over latent attention) each take two GRPO steps with the KL loss, transformers' `generate` rolling out and a
frozen reference copy scoring (which keeps such a subclass's forward)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .test_ppo import save_with_builtin_tokenizer, steps_from


def _deepseek_v4(tok):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    return DeepseekV4ForCausalLM(DeepseekV4Config(
        vocab_size=len(tok), hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=8, num_nextn_predict_layers=0, hc_mult=2,
        max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None))


def _glm5(tok):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    return GlmMoeDsaForCausalLM(GlmMoeDsaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, index_topk=4, index_head_dim=16,
        index_n_heads=2, head_dim=8, first_k_dense_replace=1, max_position_embeddings=256,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None))


@pytest.mark.parametrize("family, build, name", [("deepseek_v4", _deepseek_v4, "DeepseekV4ForCausalLM"),
                                                 ("glm_moe_dsa", _glm5, "GlmMoeDsaForCausalLM")])
def test_grpo_steps_on_the_transformers_fallback(tmp_path, family, build, name):
    if importlib.util.find_spec(f"transformers.models.{family}") is None:
        pytest.skip(f"this transformers has no {family}")
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    path = save_with_builtin_tokenizer(build(tok), tmp_path / "model")
    trainer, metrics = steps_from(tmp_path, path, "actor_rollout_ref.actor.use_kl_loss=true")
    assert type(trainer.worker.model).__name__ == name and trainer.worker.rollout.name == "hf"
    assert trainer.global_step == 2
    assert torch.isfinite(torch.tensor([metrics[2]["actor/pg_loss"], metrics[2]["actor/kl_loss"]])).all()
