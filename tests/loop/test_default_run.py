"""`lathe train` with no arguments: the built-in GRPO run must make the reward clearly rise past 0.8."""

from __future__ import annotations

import json

import pytest

from lathe.cli import main


@pytest.mark.slow
def test_builtin_default_run_lifts_reward_above_0_8(tmp_path, capfd):
    assert main(["train", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]"]) == 0
    printed = "".join(capfd.readouterr())                  # the demo's output, redirected as into a log file
    assert "Writing model shards" not in printed and "Loading weights" not in printed   # transformers' bars: off
    assert "\x1b" not in printed and "\r" not in printed   # no colour codes, no redrawn live line
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert len(scores) == 250
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert first < 0.6, f"the warm start alone already solves the task ({first:.2f}): RL has nothing to show"
    assert last >= 0.8, f"GRPO lifted the reward only to {last:.2f} (from {first:.2f})"
