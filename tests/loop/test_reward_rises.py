"""GAE with a critic and the DAPO preset must also lift the built-in task's reward, not just run."""

from __future__ import annotations

import json

import pytest

from lathe.cli import main

from helpers import warm_started


def scores_of(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["algorithm.adv_estimator=gae", "critic.optim.lr=5e-4"],
    ["dapo"],
], ids=["gae-critic", "dapo"])
def test_reward_rises(tmp_path, args):
    source, overrides = (args[:1], args[1:]) if "=" not in args[0] else ([], args)
    assert main(["train", *source, *warm_started(), *overrides, "trainer.total_training_steps=100", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.logger=[console]",
                 f"trainer.default_local_dir={tmp_path}"]) == 0
    scores = scores_of(tmp_path)
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last >= first + 0.15, f"reward went from {first:.2f} to {last:.2f} in 100 steps"
