"""GRPO steps on a tiny Nemotron-H checkpoint (Mamba2, attention without RoPE, relu^2 MLP and MoE layers): lathe's
decoder trains (the reference and the update prefix-grouped: each prompt's layers once), lathe's engine generates
(its Mamba2 states beside the paged KV cache), the sampling log-probs equal the trainer's, and the checkpoint saved is
the Hub's layout, which transformers reads back."""

from __future__ import annotations

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.models.decoder import LatheCausalLM

from .test_ppo import read_metrics, run

pytest.importorskip("transformers.models.nemotron_h")


def test_grpo_steps_on_a_nemotron_h_checkpoint(tmp_path):
    from safetensors import safe_open
    from transformers import NemotronHForCausalLM

    from lathe.data.builtin import builtin_tokenizer

    from models.nemotron_tiny import nemotron_model
    tok = builtin_tokenizer()
    nemotron_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(
        tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'model'}",
                  "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
                  "trainer.test_freq=-1", "trainer.val_before_train=false", "actor_rollout_ref.actor.use_kl_loss=true",
                  "actor_rollout_ref.actor.use_prefix_grouper=true")
    actor = trainer.worker.model
    assert isinstance(actor, LatheCausalLM) and actor.config.nemotron is not None
    assert isinstance(trainer.worker.rollout.backend, LatheEngine)
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert metrics[2]["training/rollout_probs_diff_max"] < 1e-4     # the engine's sampling log-probs = the trainer's
    saved = tmp_path / "run" / "global_step_2" / "actor" / "huggingface"
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        assert "backbone.layers.1.mixer.experts.0.up_proj.weight" in set(f.keys())
    back, info = NemotronHForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
