"""ReMax in fully-async mode: each request's greedy twin is generated on the replica beside its samples, and its
reward is the baseline (both pools in this process: tests/loop/test_async_inprocess.py). On-policy it is the
synchronous loop's ReMax."""

from __future__ import annotations

from loop.test_async_inprocess import ON_POLICY, assert_same_steps, in_process_pools, train  # noqa: F401


def test_on_policy_remax_is_the_synchronous_loops(tmp_path, in_process_pools):
    remax = ["algorithm.adv_estimator=remax"]
    sync = train(tmp_path / "sync", *remax)
    on_policy = train(tmp_path / "async", *remax, *ON_POLICY, "data.gen_batch_size=2")
    assert_same_steps(sync, on_policy, keys=("actor/pg_loss", "actor/grad_norm", "critic/score/mean",
                                             "critic/advantages/mean", "critic/advantages/max", "response_length/mean"))
    assert any(abs(r["critic/advantages/mean"]) > 1e-3 for r in sync), "precondition: the baselines are not the mean"
