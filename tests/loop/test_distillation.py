"""On-policy distillation from the command line (`distillation.*`): teacher log-probs after generation, the loss in
the actor's update, verl's `distillation/*` metrics."""

from __future__ import annotations

import json

import pytest
import torch

from lathe.cli import main

from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model

FAST = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=6", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console]", "distillation.enabled=true", "actor_rollout_ref.model.warm_start.steps=0",
        "trainer.seed=42"]


def train(tmp_path, *overrides: str) -> dict[int, dict]:
    run_dir = tmp_path / "run"
    assert main(["train", *FAST, f"trainer.default_local_dir={run_dir}", *overrides]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


LOSSES = {"k1-reward": (["loss_mode=k1", "use_policy_gradient=true", "loss_max_clamp=10.0"],
                        ["distillation/pg_clipfrac", "distillation/ppo_kl", "distillation/pg_clipfrac_lower"]),
          "topk": (["loss_mode=forward_kl_topk", "topk=8", "log_prob_min_clamp=-10.0"],
                   ["distillation/student_mass", "distillation/teacher_mass_min", "distillation/overlap_ratio",
                    "distillation/overlap_token_advantage"])}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_teacher_equal_to_the_student_adds_nothing(tmp_path, loss):
    # the built-in model is built from trainer.seed: the same weights as the student's
    keys, names = LOSSES[loss]
    metrics = train(tmp_path, "trainer.total_training_steps=2",
                    "distillation.teacher_models.teacher_model.model_path=builtin:tiny",
                    *(f"distillation.distillation_loss.{k}" for k in keys))
    first, second = metrics[1], metrics[2]
    for name in ("distillation/loss", "distillation/loss_min", "distillation/loss_max", "distillation/abs_loss",
                 "timing_s/teacher", *names):
        assert name in first, name
    if loss == "topk":                                             # the same distribution: the same top k
        assert first["distillation/overlap_ratio"] == 1.0
    assert abs(first["distillation/abs_loss"]) < 1e-5 and abs(first["distillation/loss"]) < 1e-5
    if loss == "k1-reward":
        # without a warm start every reward is 0, so neither the task nor the teacher moves the student (the
        # truncated top-k KL has a gradient even at p = q: sum over k tokens of q grad log p is not 0)
        assert abs(second["distillation/loss"]) < 1e-5
        assert first["actor/grad_norm"] < 1e-4 and second["actor/grad_norm"] < 1e-4


def test_distillation_alone_pulls_the_student_towards_the_teacher(tmp_path):
    tok, teacher = builtin_tokenizer(), tmp_path / "teacher"
    model = build_builtin_model("tiny", vocab_size=len(tok), seed=7)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)        # sharper than the near-uniform random student: a KL to close
    model.save_pretrained(teacher)
    tok.save_pretrained(teacher)
    metrics = train(tmp_path, "trainer.total_training_steps=10", f"distillation.teacher_models.teacher_model.model_path={teacher}",
                    "data.train_batch_size=8", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                    "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                    "distillation.distillation_loss.loss_mode=k3", "distillation.distillation_loss.use_task_rewards=false",
                    "actor_rollout_ref.actor.optim.lr=3e-3")
    kl = [metrics[s]["distillation/loss"] for s in sorted(metrics)]
    assert "distillation/pg_clipfrac" not in metrics[1]           # the supervised form has no surrogate
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:2]) / 2, kl            # ~0.58 -> ~0.40 (seeded; each step is noisy)
