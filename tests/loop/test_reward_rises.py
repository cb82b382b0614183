"""GAE with a critic and the DAPO preset must also lift the built-in task's reward, not just run."""

from __future__ import annotations

import json

import pytest

from lathe.cli import main

from helpers import stop_once_risen, warm_started


def scores_of(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]


@pytest.mark.slow
@pytest.mark.parametrize("args,steps,rise", [
    (["algorithm.adv_estimator=gae", "critic.optim.lr=5e-4"], 30, 0.06),   # 10-step means 0.41 -> 0.51 (2026-11-29)
    (["dapo"], 40, 0.05),                                                  # 0.45 -> 0.53
], ids=["gae-critic", "dapo"])
def test_reward_rises(tmp_path, monkeypatch, args, steps, rise):
    """A 10-step mean of 256 samples a step varies by ~0.01, so a rise of 0.05 is the algorithm learning (within
    `steps` steps: the run stops once its last 10 steps show the rise, tests/helpers.py stop_once_risen)."""
    stop_once_risen(monkeypatch, rise)
    source, overrides = (args[:1], args[1:]) if "=" not in args[0] else ([], args)
    assert main(["train", *source, *warm_started(), *overrides, f"trainer.total_training_steps={steps}",
                 "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.logger=[console]",
                 f"trainer.default_local_dir={tmp_path}"]) == 0
    scores = scores_of(tmp_path)
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last >= first + rise, f"reward went from {first:.2f} to {last:.2f} in {len(scores)} steps"


@pytest.mark.slow
def test_lora_lifts_the_reward(tmp_path, monkeypatch):
    """The built-in task with LoRA (rank 16 on every linear layer, the usual ~10x learning rate): only the adapters
    train, and the reward still rises (25 steps: 10-step means 0.43 -> 0.50, 2026-11-29; the run stops once its
    last 10 steps show the rise, tests/helpers.py stop_once_risen)."""
    stop_once_risen(monkeypatch, 0.05)
    assert main(["train", *warm_started(), "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                 "actor_rollout_ref.actor.optim.lr=3e-3", "trainer.total_training_steps=25", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.logger=[console]",
                 f"trainer.default_local_dir={tmp_path}"]) == 0
    scores = scores_of(tmp_path)
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last >= first + 0.05, f"reward went from {first:.2f} to {last:.2f} in {len(scores)} steps"
