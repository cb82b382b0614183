"""GRPO steps on a tiny Qwen3.5 checkpoint (hybrid linear attention): lathe's decoder trains and lathe's engine
generates (its linear-attention states beside the paged KV cache: `lathe.engine.linear_state`)."""

from __future__ import annotations

import logging

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.models.decoder import LatheCausalLM

from .test_dump import PARITY_REWARD
from .test_ppo import read_metrics, run


def _checkpoint(path):
    """A tiny random Qwen3.5 checkpoint with the built-in tokenizer, saved at `path`."""
    from transformers import AutoModelForCausalLM

    from lathe.data.builtin import builtin_tokenizer

    from models.lathe_tiny import hybrid_config
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config("qwen3_5_text", vocab_size=len(tok),
                                                           eos_token_id=tok.eos_token_id,
                                                           pad_token_id=tok.pad_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)


def test_grpo_steps_on_a_qwen3_5_checkpoint(tmp_path, caplog):
    from transformers import Qwen3_5ForCausalLM
    _checkpoint(tmp_path / "model")
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


def test_prefix_grouped_qwen3_5_steps_equal_the_per_row_run(tmp_path):
    """Two GRPO steps with the KL loss, the reference's and the update's passes prefix-grouped (each prompt's linear
    layers once, each response from its prompt's final states): the losses and gradient norms of the per-row run
    (tests/train/test_prefix_group.py: each pass's numbers); a reward by the response's length parity gives the
    groups advantages."""
    _checkpoint(tmp_path / "model")
    (tmp_path / "parity.py").write_text(PARITY_REWARD)
    runs = {}
    for grouped in (True, False):
        run(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'model'}",
            "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            f"reward.custom_reward_function.path={tmp_path / 'parity.py'}",
            f"actor_rollout_ref.actor.use_prefix_grouper={str(grouped).lower()}", name=f"run{grouped}")
        runs[grouped] = read_metrics(tmp_path / f"run{grouped}")
    assert runs[True][1]["actor/grad_norm"] > 0.1 and runs[True][2]["actor/kl_loss"] > 0
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        for step in (1, 2):
            assert runs[True][step][key] == pytest.approx(runs[False][step][key], rel=1e-4, abs=1e-7), (key, step)
