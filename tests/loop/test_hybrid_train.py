"""GRPO steps on a tiny Qwen3.5 checkpoint (hybrid linear attention): lathe's decoder trains and lathe's engine
generates (its linear-attention states beside the paged KV cache: `lathe.engine.linear_state`)."""

from __future__ import annotations

import logging

import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.models.decoder import LatheCausalLM

from .test_ppo import read_metrics, run


def test_grpo_steps_on_a_qwen3_5_checkpoint(tmp_path, caplog):
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM

    from lathe.data.builtin import builtin_tokenizer

    from models.lathe_tiny import hybrid_config
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config("qwen3_5_text", vocab_size=len(tok),
                                                           eos_token_id=tok.eos_token_id,
                                                           pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with caplog.at_level(logging.INFO, logger="lathe"):
        trainer = run(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'model'}",
                      "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
                      "trainer.test_freq=-1", "trainer.val_before_train=false")
    actor = trainer.worker.model
    assert isinstance(actor, LatheCausalLM) and actor.config.linear_attention is not None
    assert isinstance(trainer.worker.rollout.backend, LatheEngine)
    assert any("prefix caching is off for Qwen3_5ForCausalLM" in r.getMessage() for r in caplog.records)
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert metrics[2]["training/rollout_probs_diff_max"] < 1e-4     # the engine's sampling log-probs = the trainer's
    back, info = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "run" / "global_step_2" / "actor" / "huggingface",
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
