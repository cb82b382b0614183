"""lathe.cluster.async_roles over Ray: a tensor-parallel rollout replica of fully-async training (two CPU ranks over
gloo) whose follower's engine step raises while the driver waits for its leader to pause (letting the running
requests finish: the leader waits for its follower inside the step's collective, till nccl_timeout). The driver's
call ends at once with the follower's rank and error (`RolloutGroup.watch`; it used to wait out nccl_timeout and
then name the leader), and the pool stops in seconds instead of waiting for the leader's stuck thread."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

pytestmark = pytest.mark.slow

NCCL_TIMEOUT = 60               # what the leader waits for its follower; the error comes long before
FAILING_STEP = 3                # the follower's engine raises at its third step
FOLLOWER_FAILED = (r"rollout rank 1 \(rank 1 of the tensor-parallel rollout replica of ranks 0\.\.1\): the engine "
                   r"failed: ValueError\('the device broke'\)")


def failing_replica(cfg, path: str):
    """A rollout replica whose engine raises at step FAILING_STEP on rank 1 (the follower)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lathe.workers.fully_async import RolloutWorker
    worker = RolloutWorker(cfg, path, {"impl": "auto"}, SimpleNamespace(pad_token_id=0, eos_token_id=2),
                           device_type="cpu")
    if dist.get_rank() == 1:
        step, steps = worker.engine.step, [0]

        def failing():
            steps[0] += 1
            if steps[0] == FAILING_STEP:
                raise ValueError("the device broke")
            return step()

        worker.engine.step = failing
    return worker


class NoTrainer:
    """The trainer group's side of `AsyncCluster.close` (nothing to close)."""

    world_size = 1

    def submit_each(self, role, method, per_rank):
        return [None]

    def gather(self, refs, what, watching=None):
        return [None]

    def shutdown(self):
        pass


def test_a_followers_failing_step_ends_the_drivers_wait_for_its_leader_at_once(tmp_path):
    from lathe.cluster import AsyncCluster
    from lathe.cluster.async_roles import RolloutGroup
    from lathe.cluster.placement import ResourcePool
    from lathe.cluster.worker_group import RayWorkerGroup
    from lathe.config import load_config
    from lathe.generation import SamplingParams
    from lathe.workers.fully_async import ROLLOUT
    from models.lathe_tiny import save_hf
    path = str(save_hf(tmp_path, "llama", tie=True)[0])
    cfg = load_config("default", ["rollout.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=false",
                                  "data.train_batch_size=0", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                  f"actor_rollout_ref.nccl_timeout={NCCL_TIMEOUT}", "data.max_response_length=24"])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(ResourcePool(1, 2, use_gpu=False, name="rollout"), name="rollout",
                           timeout_s=NCCL_TIMEOUT, max_concurrency=5)
    cluster = AsyncCluster(NoTrainer(), group, None, None, None, False, [], 1)
    try:
        group.build(ROLLOUT, failing_replica, cfg, path)
        replicas = RolloutGroup(group, pad_id=0, timeout_s=NCCL_TIMEOUT, tp=2)
        replicas.watch()
        replicas.submit({0: [("a", [[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=24, ignore_eos=True), 0)]})
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=FOLLOWER_FAILED) as err:
            replicas.pause(partial=False)            # (the leader waits for the requests, inside the failed step)
        waited = time.monotonic() - start
        note = err.value.__notes__[0]
        assert "rollout rank 1 on " in note and "engine thread, while the driver waited for rollout.pause" in note
        assert waited < 10, f"the driver heard of the failed step after {waited:.0f} s"
        assert group.failure.startswith("rank 1 raised in its engine thread")
    finally:
        start = time.monotonic()
        cluster.close()                          # (the leader's thread waits for its follower: not waited for)
    assert time.monotonic() - start < 20, "close waited (30 s) for the leader's thread stuck in the failed step"
