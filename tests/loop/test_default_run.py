"""`lathe train` with no arguments: the built-in GRPO run must lift the sampled score past 0.93 and leave a
checkpoint that `lathe export` turns into a model."""

from __future__ import annotations

import json

import pytest

from lathe.cli import main


@pytest.mark.slow
def test_builtin_default_run_lifts_the_score_and_leaves_a_checkpoint(tmp_path):
    assert main(["train", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert len(scores) == 100
    first, last = sum(scores[:5]) / 5, sum(scores[-10:]) / 10
    assert last >= 0.93, f"GRPO lifted the sampled score only to {last:.2f} (from {first:.2f})"
    assert last >= first + 0.05, f"the warm start alone already scores {first:.2f}: RL has nothing to show"
    assert (tmp_path / "global_step_100").is_dir()              # save_freq and the last step
    assert main(["export", str(tmp_path), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "config.json").exists()
