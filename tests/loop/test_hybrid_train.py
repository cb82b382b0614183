"""GRPO steps on tiny Qwen3.5 / Qwen3.5-MoE checkpoints (hybrid linear attention): lathe's decoder trains, and
transformers generate is the rollout, as lathe's engine does not run these layers yet (refused by name)."""

from __future__ import annotations

import logging

import pytest
import torch

from lathe.models.decoder import LatheCausalLM
from lathe.models.hf import lathe_from_transformers
from lathe.rollout.build import resolve_rollout_name

from .test_ppo import read_metrics, run


def _checkpoint(tmp_path, family: str):
    from transformers import AutoModelForCausalLM

    from lathe.data.builtin import builtin_tokenizer

    from models.lathe_tiny import hybrid_config
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                                           pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return model


@pytest.mark.parametrize("family", ["qwen3_5_text"])     # (Qwen3.5-MoE: tests/models/test_hybrid.py)
def test_grpo_steps_train_lathes_decoder_and_generate_with_transformers(tmp_path, family, caplog):
    from transformers import AutoModelForCausalLM
    hf = _checkpoint(tmp_path, family)
    with caplog.at_level(logging.INFO, logger="lathe"):
        trainer = run(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'model'}",
                      "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
                      "trainer.test_freq=-1", "trainer.val_before_train=false")
    model = trainer.worker.model
    assert isinstance(model, LatheCausalLM) and model.config.linear_attention is not None
    assert any("rollout: transformers generate" in r.getMessage() and "linear-attention" in r.getMessage()
               for r in caplog.records)
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert metrics[2]["training/rollout_probs_diff_max"] < 1e-4     # transformers' sampling log-probs = lathe's
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "global_step_2" / "actor" / "huggingface",
                                                   output_loading_info=True)
    assert type(_).__name__ == type(hf).__name__ and not info["missing_keys"] and not info["unexpected_keys"]


def test_lathes_engine_is_refused_by_name(tmp_path):
    from lathe.engine.llm_engine import LatheEngine

    from models.lathe_tiny import hf_model
    actor = lathe_from_transformers(hf_model("qwen3_next"))
    with pytest.raises(ValueError, match=r"rollout.name=lathe: lathe's engine does not run Qwen3NextForCausalLM.*"
                                         r"Fix: set actor_rollout_ref.rollout.name=auto"):
        resolve_rollout_name("lathe", actor, impl="auto")
    assert resolve_rollout_name("auto", actor, impl="auto") == "hf"
    assert resolve_rollout_name("vllm", actor, impl="auto") == "hf"
    with pytest.raises(NotImplementedError, match="engine does not run Qwen3NextForCausalLM"):
        LatheEngine(actor, eos_token_id=0)
