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


def test_grpo_steps_decode_speculatively_with_the_trained_mtp_layers(tmp_path):
    """`mtp.enable_rollout=true`: the rollout drafts with the MTP layer (verl's acceptance metrics logged at every
    step) and, after the update, the engine's MTP layer holds the trained weights (the sync carries them)."""
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    path, _ = save_mimo(tmp_path / "model", vocab_size=len(tok), tokenizer=tok)
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.warm_start.steps=0",
                  "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
                  "actor_rollout_ref.model.mtp.enable_rollout=true", "actor_rollout_ref.rollout.name=sglang",
                  "actor_rollout_ref.model.mtp.speculative_num_steps=2",
                  "actor_rollout_ref.model.mtp.speculative_num_draft_tokens=3",
                  "actor_rollout_ref.model.use_remove_padding=true",
                  "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false")
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        assert 0 <= metrics[step]["rollout/spec_accept_rate"] <= 1
        assert metrics[step]["rollout/spec_draft_tokens"] > 0
    engine = trainer.worker.rollout.backend
    assert engine.num_speculative_tokens == 2
    actor = dict(trainer.worker.model.state_dict())
    for name, t in engine.model.state_dict().items():
        if name.startswith("model.mtp_layers."):
            assert torch.equal(t.float(), actor[name].float()), name
