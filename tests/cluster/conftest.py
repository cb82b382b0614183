"""One local Ray for the cluster tests of this xdist worker (each Ray group of tests/conftest.py GROUPS runs on one
worker; the other group, on the other worker, has a cluster of its own): each `lathe train` joins it instead of
starting its own, which saves a Ray start (~15 s on 2 busy cores) per run. A test
that needs a cluster of its own (simulated nodes) is marked `own_ray`: such tests run after all the others, so that
the shared cluster is stopped for them once and never started again. A module that leaves workers or placement
groups behind (after its fixtures are torn down) gets a fresh cluster after it. A module marked `no_ray` (pure
functions, a refusal before Ray starts) gets none, and runs on either xdist worker."""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")


def pytest_configure(config):
    config.addinivalue_line("markers", "own_ray: the test starts a Ray cluster of its own")
    config.addinivalue_line("markers", "no_ray: the test starts no Ray and needs none (not in the xdist group 'ray')")


@pytest.hookimpl(trylast=True)      # after tests/conftest.py has grouped them
def pytest_collection_modifyitems(config, items):
    """The `own_ray` tests last (a stable sort: every other order is kept)."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is not None)


def _start() -> None:
    """At least 4 CPU slots (logical: Ray does not pin them), so that fully-async runs with a reward model's and the
    teachers' pools of their own place their four one-slot groups (tests/cluster/test_fully_async.py). A cluster of
    this worker's own (`address="local"`): without it, a restart while the other xdist worker's cluster runs joined
    that one (Ray 2.60 joins the latest cluster it finds on the machine) and failed on `num_cpus`."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="WARNING")


def _all_free(wait_s: float = 10) -> bool:
    """Whether every CPU slot is free again (released slots show up in Ray's resource view shortly after)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _shared(node) -> bool:
    """Whether `node` (a module or a test) runs on the shared cluster."""
    return not (node.get_closest_marker("own_ray") or node.get_closest_marker("no_ray"))


@pytest.fixture(scope="module", autouse=True)
def shared_ray(request):
    """Started before the module's own fixtures (which may train on it); after them, a cluster whose slots are
    still held (a leak) is stopped rather than handed to the next module."""
    if not _shared(request.node):
        yield
        return
    _start()
    yield
    if ray.is_initialized() and not _all_free():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _own_ray(request):
    """An `own_ray` test gets no shared cluster; the next test starts it again."""
    if request.node.get_closest_marker("no_ray"):
        yield
        return
    if not request.node.get_closest_marker("own_ray"):
        _start()
        yield
        return
    if ray.is_initialized():
        ray.shutdown()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_the_end():
    yield
    if ray.is_initialized():
        ray.shutdown()
