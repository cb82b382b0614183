"""`lathe train` with verl's batch reward manager (`reward_model.reward_manager=batch`, lathe.reward.batch): one call
of the user's function per step's batch, with the `data.reward_fn_key` column as data_sources and both sets of reward
kwargs; its dict results become the scores and `reward_extra/*` metrics."""

from __future__ import annotations

import json

import pytest

from lathe.cli import main
from lathe.reward import BatchRewardError

FAST = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console]", "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2"]

BATCH_FN = """
import json
from lathe.reward.builtin import compute_score as exact

def compute_score(data_sources, solution_strs, ground_truths, extra_infos, tag=None, bonus=0.0):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"n": len(solution_strs), "sources": sorted(set(data_sources)), "tag": tag,
                            "bonus": bonus, "ok": all(isinstance(e, dict) for e in extra_infos)}}) + "\\n")
    return [{{"score": exact(s, gt) + bonus, "hit": exact(s, gt)}} for s, gt in zip(solution_strs, ground_truths)]
"""


def test_lathe_train_scores_each_step_with_one_call_of_a_batch_function(tmp_path):
    log, reward = tmp_path / "calls.jsonl", tmp_path / "batch_reward.py"
    reward.write_text(BATCH_FN.format(log=str(log)))
    run_dir = tmp_path / "run"
    assert main(["train", *FAST, f"trainer.default_local_dir={run_dir}", "reward_model.reward_manager=batch",
                 f"custom_reward_function.path={reward}", "data.reward_fn_key=ability",
                 "+reward_model.reward_kwargs.tag=x", "+custom_reward_function.reward_kwargs.bonus=0.5"]) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # one call per step, all 8 responses; data_sources is the built-in data's `ability` column
    assert calls == [{"n": 8, "sources": ["arithmetic"], "tag": "x", "bonus": 0.5, "ok": True}] * 2
    metrics = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["critic/score/mean"] == pytest.approx(m["reward_extra/hit/mean"] + 0.5)
        assert m["reward/num_errors"] == 0


def test_lathe_train_stops_on_a_batch_function_that_returns_too_few_results(tmp_path):
    """(raised as the per-row manager's RewardFunctionFailing is: a bug in the user's function, not a config error)"""
    reward = tmp_path / "short_reward.py"
    reward.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                      "    return [1.0] * (len(solution_strs) - 1)\n")
    with pytest.raises(BatchRewardError, match=r"short_reward.py' \(reward_model.reward_manager=batch\) returned 7 "
                                               r"results \(\[1.0, 1.0.*\) for a batch of 8 responses"):
        main(["train", *FAST, f"trainer.default_local_dir={tmp_path / 'run'}", "reward_model.reward_manager=batch",
              f"custom_reward_function.path={reward}"])
