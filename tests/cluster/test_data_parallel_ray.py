"""Data-parallel attention in `lathe train` (`lathe.engine.data_parallel`) on 2 Ray workers over gloo: verl's
`rollout.data_parallel_size=2` with `expert_parallel_size=2` makes one engine of the two workers' replicas, each with
its own prompts and half the experts; its samples are the one process's and its engines follow the updates
(`tests/cluster/test_mesh_gpu.py`'s case, on CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from cluster.test_mesh_gpu import data_parallel_attention  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_engine_of_two_replicas_trains_as_one_process(tmp_path):
    data_parallel_attention(tmp_path, "cpu")


def test_fully_async_replicas_of_data_parallel_attention_train_as_the_synchronous_loop(tmp_path):
    """Fully async on-policy (test_fully_async.py's keys: staleness 0, a sync after every update) with a rollout pool
    of 2 ranks that form one engine of data-parallel attention (each replica its own requests and 2 of the 4 experts,
    stepping in lockstep in threads of their own: `lathe.workers.fully_async`), the new weights sent whole to both
    ranks: the samples and updates of the synchronous loop on one process (1e-5), nothing stale or partial, and the
    replicas' log-probs the trainer's at every step (the weights arrived, each rank's experts its own)."""
    from cluster.test_fully_async import ON_POLICY
    from cluster.test_mesh_gpu import STEPS, moe_model
    from cluster.test_ray import assert_same, train
    base = ("trainer.device=cpu", STEPS, *moe_model(tmp_path))
    sync = train(tmp_path / "sync", *base)
    on_policy = train(tmp_path / "async", *base, *ON_POLICY, "rollout.n_gpus_per_node=2",
                      "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.data_parallel_size=2",
                      "actor_rollout_ref.rollout.expert_parallel_size=2",
                      "actor_rollout_ref.rollout.data_parallel_attention=always",
                      "ray_kwargs.ray_init.num_cpus=4")      # (three one-slot workers: the shared cluster's slots)
    assert len(sync) == len(on_policy) == 2
    for a, b in zip(sync, on_policy):
        assert_same(a, b)
        assert b["fully_async/staleness/max"] == 0 and b["fully_async/partial/total_partial_num"] == 0
        assert b["fully_async/rollout_probs_diff_current_max"] == b["training/rollout_probs_diff_max"] < 1e-4
