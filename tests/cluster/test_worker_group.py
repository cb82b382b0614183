"""lathe.cluster.worker_group on its own: ranks spread over two (simulated) nodes, and failures that name the rank
instead of hanging. The module runs on a Ray cluster of its own (two nodes), after every other cluster test
(tests/cluster/conftest.py), so that the shared cluster is started once in a session."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from lathe.cluster.placement import ResourcePool  # noqa: E402
from lathe.cluster.worker_group import RayWorkerGroup, WorkerGroupError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]


class Probe:
    """A role that misbehaves on one rank on demand."""

    def __init__(self):
        import torch.distributed as dist
        self.rank = dist.get_rank()

    def whoami(self) -> int:
        return self.rank

    def boom(self):
        if self.rank == 1:
            raise ValueError("bad input on rank 1")
        return self.rank

    def hang(self, rank: int, release: str):
        """On `rank`: no answer until the file `release` exists (both simulated nodes share this machine's disk),
        a minute at most."""
        deadline = time.monotonic() + 60
        while self.rank == rank and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.rank

    def die(self):
        if self.rank == 1:
            os._exit(3)
        return self.rank

    def fail_after(self, seconds: float):
        """A call that runs for the group's life (`RayWorkerGroup.watch`) and fails after `seconds`."""
        time.sleep(seconds)
        raise ValueError("the engine thread broke")


@pytest.fixture
def two_nodes():
    """A Ray cluster of two simulated nodes with one CPU slot each."""
    from ray.cluster_utils import Cluster
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_workers_spread_over_two_nodes_and_failures_name_the_rank(two_nodes, tmp_path: Path):
    """A rank that raises, stays silent past the deadline or dies is named; a group whose rank is stuck in a call
    (here: waiting on a rank that died) stops at once instead of waiting for it."""
    group = RayWorkerGroup(ResourcePool(2, 1, use_gpu=False, timeout_s=60), name="probe", timeout_s=60)
    stopped = False
    try:
        assert len({node["node_id"] for node in group.nodes}) == 2       # one rank on each node
        assert group.placement().count("node ") == 2
        group.build("probe", Probe)
        group.timeout_s = 5.0       # started (slowly on a busy machine); the calls below wait 5 s
        assert group.call("probe", "whoami") == [0, 1]
        with pytest.raises(ValueError, match="bad input on rank 1") as err:
            group.call("probe", "boom")
        assert "probe rank 1 on" in "\n".join(err.value.__notes__)
        with pytest.raises(WorkerGroupError, match=r"probe.hang got no answer within 5 s from rank\(s\) 1") as err:
            group.call("probe", "hang", 1, str(tmp_path / "release1"))
        assert "rank 0: probe.hang" in str(err.value) and "nccl_timeout" in str(err.value)
        (tmp_path / "release1").touch()                   # rank 1 answers its hang; then it is asked to die
        with pytest.raises(WorkerGroupError, match="probe: rank 1 on .* died during probe.die"):
            group.call("probe", "die")
        with pytest.raises(WorkerGroupError, match="probe: rank 1 on .* died during probe.hang"):
            group.call("probe", "hang", 0, str(tmp_path / "release0"))      # rank 0 left waiting
        start, stopped = time.monotonic(), True
        group.shutdown()
        assert time.monotonic() - start < 8, "shutdown waited for the stuck rank 0 (10 s)"
        watching_a_group_of_one_ends_another_groups_wait(tmp_path)
    finally:
        (tmp_path / "release0").touch()
        if not stopped:
            group.shutdown()


def watching_a_group_of_one_ends_another_groups_wait(tmp_path: Path) -> None:
    """A group's watched call that raises ends a wait on another group that watches it (a weight sync's senders
    waiting for a receiver that failed) at once, with the watched rank's error; the waiting group's rank is left
    running and its shutdown does not ask it."""
    waiter = RayWorkerGroup(ResourcePool(1, 1, use_gpu=False, timeout_s=60, name="waiter"), name="waiter",
                            timeout_s=60)
    watched = RayWorkerGroup(ResourcePool(1, 1, use_gpu=False, timeout_s=60, name="watched"), name="watched",
                             timeout_s=60, max_concurrency=2)
    release = tmp_path / "release_waiter"
    try:
        waiter.build("probe", Probe)
        watched.build("probe", Probe)
        watched.watch(watched.submit_each("probe", "fail_after", [((1.0,), {})]), "its engine thread")
        start = time.monotonic()
        with pytest.raises(ValueError, match="the engine thread broke") as err:
            waiter.gather(waiter.submit_each("probe", "hang", [((0, str(release)), {})]), "probe.hang",
                          watching=watched)
        assert time.monotonic() - start < 20, "the wait went on after the watched rank failed"
        assert "watched rank 0" in "\n".join(err.value.__notes__) and "waiter's probe.hang" in "\n".join(
            err.value.__notes__)
        assert watched.failure and 0 in waiter.unanswered
    finally:
        start = time.monotonic()
        waiter.shutdown()
        watched.shutdown()
        assert time.monotonic() - start < 8, "a shutdown asked the stuck rank to leave (10 s)"
        release.touch()
