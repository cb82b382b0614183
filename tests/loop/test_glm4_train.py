"""GRPO steps on a tiny GLM-4 checkpoint (RoPE over half of each head in interleaved pairs, norms on the attention's
and MLP's outputs, a fused gate_up_proj on disk): lathe's decoder trains and its engine generates with the sampling
log-probs the trainer's; the checkpoint saved is GLM-4's layout, which transformers reads back; with LoRA, the adapter
saved is one PEFT applies to transformers' GLM-4 (`gate_up_proj` at twice the rank: `lathe.models.glm4`) to the merged
model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.models.decoder import LatheCausalLM

from .test_ppo import reads_back, save_with_builtin_tokenizer, steps_from


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_steps_on_a_glm4_checkpoint(tmp_path, lora):
    from transformers import Glm4ForCausalLM

    from lathe.data.builtin import builtin_tokenizer

    from models.glm4_tiny import glm4_model
    tok = builtin_tokenizer()
    path = save_with_builtin_tokenizer(glm4_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                                  pad_token_id=tok.pad_token_id), tmp_path / "model")
    keys = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"] if lora else []
    trainer, metrics = steps_from(tmp_path, path, "actor_rollout_ref.actor.use_kl_loss=true", *keys)
    actor = trainer.worker.model
    assert isinstance(actor, LatheCausalLM) and actor.config.rope_interleave
    assert isinstance(trainer.worker.rollout.backend, LatheEngine)
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert metrics[2]["training/rollout_probs_diff_max"] < 1e-4     # the engine's sampling log-probs = the trainer's
    assert reads_back(Glm4ForCausalLM, tmp_path / "run")
    if lora:
        peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
        saved = tmp_path / "run" / "global_step_2" / "actor"
        base = Glm4ForCausalLM.from_pretrained(path).eval()
        merged = Glm4ForCausalLM.from_pretrained(saved / "huggingface").eval()
        adapted = peft.PeftModel.from_pretrained(base, saved / "lora_adapter").eval()
        ids = torch.randint(1, len(tok), (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want, got = merged(ids).logits, adapted(ids).logits
        assert (got - want).norm() / want.norm() < 1e-4
        config = json.loads((saved / "lora_adapter" / "adapter_config.json").read_text())
        assert "gate_up_proj" in config["target_modules"] and config["rank_pattern"] == {"gate_up_proj": 8}
