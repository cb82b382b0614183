"""A generative judge in fully-async mode (both pools in this process: tests/loop/test_async_inprocess.py): the
trainer pool's ranks hold the judge's engine and score each batch before its update, joined with the rule's score
as `judge.combine` says. On-policy it is the synchronous loop's judged training."""

from __future__ import annotations

from loop import test_async_inprocess as harness
from loop.test_async_inprocess import ON_POLICY, assert_same_steps, train
from loop.test_judge import judge_overrides, tiny_judge

in_process_pools = harness.in_process_pools          # the fixture (both pools in this process)

KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/score/max", "critic/score/min",
        "response_length/mean")


def test_on_policy_judge_is_the_synchronous_loops(tmp_path, in_process_pools):
    judge = judge_overrides(tiny_judge(tmp_path / "judge"), "reward_model.judge.combine=sum")
    sync = train(tmp_path / "sync", *judge)
    on_policy = train(tmp_path / "async", *judge, *ON_POLICY, "data.gen_batch_size=2")
    assert_same_steps(sync, on_policy, keys=KEYS)
    for a, b in zip(sync, on_policy):
        judged = ("reward_judge/score/mean", "reward_judge/parse_failure_rate", "reward_judge/response_tokens")
        assert all(abs(a[k] - b[k]) <= 1e-6 for k in judged), judged             # the judge's own metrics
        assert b["timing_s/reward"] > 0
