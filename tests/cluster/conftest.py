"""One local Ray for the cluster tests of this xdist worker (they all run on one: tests/conftest.py GROUPS): each
`lathe train` joins it instead of starting its own, which saves a Ray start (~15 s on 2 busy cores) per run. A test
that needs a cluster of its own (simulated nodes) is marked `own_ray`: the shared one is stopped for it and started
again for the next. A test that leaves workers or placement groups behind gets a fresh cluster after it."""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")


def pytest_configure(config):
    config.addinivalue_line("markers", "own_ray: the test starts a Ray cluster of its own")


def _start() -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="WARNING")


@pytest.fixture(autouse=True)
def shared_ray(request):
    if request.node.get_closest_marker("own_ray"):
        if ray.is_initialized():
            ray.shutdown()
        yield
        return
    _start()
    yield
    if not ray.is_initialized():          # the test (or lathe, on a failure) shut it down
        return
    deadline = time.monotonic() + 10       # released slots show up in the resource view shortly after
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:   # something still holds CPU slots: do not hand it to the next test
            ray.shutdown()
            return
        time.sleep(0.2)


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_the_end():
    yield
    if ray.is_initialized():
        ray.shutdown()
