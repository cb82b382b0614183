"""A learned reward model in fully-async mode (both pools in this process: tests/loop/test_async_inprocess.py): the
driver queues the requests unscored and the trainer pool's ranks score each batch with the reward model before its
update. On-policy it is the synchronous loop's reward-model training: the same scores, advantages and updates."""

from __future__ import annotations

from helpers import RM_TEMPLATE, tiny_reward_model
from loop import test_async_inprocess as harness
from loop.test_async_inprocess import ON_POLICY, assert_same_steps, train
from loop.test_reward_model import rm_overrides

in_process_pools = harness.in_process_pools          # the fixture (both pools in this process)

KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/score/max", "critic/score/min",
        "critic/advantages/mean", "critic/advantages/max", "response_length/mean")


def test_on_policy_reward_model_is_the_synchronous_loops(tmp_path, in_process_pools):
    rm = rm_overrides(tiny_reward_model(tmp_path / "rm", chat_template=RM_TEMPLATE))
    sync = train(tmp_path / "sync", *rm)
    on_policy = train(tmp_path / "async", *rm, *ON_POLICY, "data.gen_batch_size=2")
    assert_same_steps(sync, on_policy, keys=KEYS)
    for row in on_policy:
        assert "reward_extra/acc/mean" not in row and row["timing_s/reward"] > 0   # the reward model's scores
    assert all(r["critic/score/max"] - r["critic/score/min"] > 1e-3 for r in sync), "precondition: scores differ"
