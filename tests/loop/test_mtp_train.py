"""A GRPO step on a tiny MiMo checkpoint with `actor_rollout_ref.model.mtp` on: the MTP layers train beside the policy
(`lathe.train.mtp`), verl's metric is logged, and the step's checkpoint keeps them."""

from __future__ import annotations

import math

import torch

from lathe.models.io import read_state_dict
from lathe.models.mtp import has_mtp

from models.mimo_tiny import save_mimo

from .test_ppo import read_metrics, run


def test_a_grpo_step_trains_and_saves_the_mtp_layers(tmp_path):
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    path, _ = save_mimo(tmp_path / "model", vocab_size=len(tok), tokenizer=tok)
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.warm_start.steps=0",
                  "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
                  "actor_rollout_ref.model.mtp.detach_encoder=true",
                  "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.2",
                  "actor_rollout_ref.model.use_remove_padding=true",
                  "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.test_freq=-1",
                  "trainer.val_before_train=false")
    assert has_mtp(trainer.worker.model)
    metrics = read_metrics(tmp_path / "run")[1]
    assert math.isfinite(metrics["actor/mtp_losses/mtp_1_loss"]) and metrics["actor/mtp_losses/mtp_1_loss"] > 0
    start = read_state_dict(path)
    saved = read_state_dict(tmp_path / "run" / "global_step_1" / "actor" / "huggingface")
    assert set(saved) == set(start)
    name = "model.mtp_layers.0.input_proj.weight"
    assert not torch.equal(saved[name], start[name])            # the MTP layer learned


def test_with_mtp_off_the_mtp_layers_are_saved_untouched(tmp_path):
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    path, _ = save_mimo(tmp_path / "model", vocab_size=len(tok), tokenizer=tok)
    run(tmp_path, f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.warm_start.steps=0",
        "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false")
    metrics = read_metrics(tmp_path / "run")[1]
    assert not any(k.startswith("actor/mtp_losses/") for k in metrics)
    start = read_state_dict(path)
    saved = read_state_dict(tmp_path / "run" / "global_step_1" / "actor" / "huggingface")
    mtp = [k for k in start if k.startswith("model.mtp_layers.")]
    assert mtp and all(torch.equal(saved[k], start[k]) for k in mtp)
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
