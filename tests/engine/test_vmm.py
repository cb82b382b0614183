"""`lathe.engine.vmm` on machines without it: the KV cache's fixed-address memory is on by default on CUDA, so where
the driver lacks it (no libcuda, a driver without virtual memory management, an error at the first mapping) or
LATHE_KV_FIXED_ADDRESS=0 says so, `supported` answers False, with a log line, and the cache is an ordinary tensor.
The memory itself is tested on a GPU (tests/engine/test_engine_gpu.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lathe.engine import vmm
from lathe.engine.kv_cache import KVCache


@pytest.fixture(autouse=True)
def _fresh_answer():
    vmm.supported.cache_clear()
    yield
    vmm.supported.cache_clear()


def _as_cuda(monkeypatch):
    monkeypatch.setattr(vmm.accel, "detect", lambda: SimpleNamespace(name="cuda"))


def test_off_the_gpu_and_when_switched_off_there_is_none(monkeypatch):
    monkeypatch.setattr(vmm.accel, "detect", lambda: SimpleNamespace(name="cpu"))     # (whatever this machine has)
    monkeypatch.setattr(vmm, "FixedAddress", lambda *a: pytest.fail("no CUDA: nothing to probe"))
    assert not vmm.supported(0)
    vmm.supported.cache_clear()
    _as_cuda(monkeypatch)
    monkeypatch.setenv("LATHE_KV_FIXED_ADDRESS", "0")
    monkeypatch.setattr(vmm, "FixedAddress", lambda *a: pytest.fail("LATHE_KV_FIXED_ADDRESS=0 must not probe"))
    assert not vmm.supported(0)


@pytest.mark.parametrize("error", [OSError("libcuda.so.1: cannot open shared object file"),
                                   AttributeError("cuMemCreate"),
                                   vmm.DriverError("cuMemSetAccess: CUDA driver error 801 (operation not supported)")])
def test_a_driver_without_it_leaves_the_cache_to_pytorch_with_a_log_line(monkeypatch, caplog, error):
    _as_cuda(monkeypatch)
    monkeypatch.delenv("LATHE_KV_FIXED_ADDRESS", raising=False)

    def probe(*args):
        raise error
    monkeypatch.setattr(vmm, "FixedAddress", probe)
    with caplog.at_level(logging.INFO, logger="lathe.engine.vmm"):
        assert not vmm.supported(0)
    assert "fixed-address memory unavailable" in caplog.text and str(error) in caplog.text


def test_the_cache_off_cuda_is_an_ordinary_tensor():
    cache = KVCache(2, 4, 8, 2, 16, dtype=torch.float32, device="cpu")
    assert not cache.fixed_address and cache.address is not None
    cache.free()
    assert cache.address is None
    cache.allocate()
    assert cache.k[0].shape == (5, 8, 2, 16) and not cache.fixed_address
