"""lathe.device: which accelerator this process drives (CUDA, ROCm, Ascend NPU, CPU; the last three faked where
they are absent), what lathe calls it by (visible-devices variable, collective backend, Ray resource), the CPU's
answers to the memory and random-state queries, and that nothing else in lathe calls torch.cuda."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lathe import device

SRC = Path(__file__).resolve().parents[1] / "src" / "lathe"


def fake_torch(*, cuda=False, hip=None, npu=None):
    return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: cuda), version=SimpleNamespace(hip=hip),
                           **({} if npu is None else {"npu": SimpleNamespace(is_available=lambda: npu)}))


@pytest.mark.parametrize("fake,name,device_type,variable,backend,library,resource", [
    (fake_torch(cuda=True), "cuda", "cuda", "CUDA_VISIBLE_DEVICES", "nccl", "NCCL", "GPU"),
    (fake_torch(cuda=True, hip="6.4.43482"), "rocm", "cuda", "HIP_VISIBLE_DEVICES", "nccl", "RCCL", "GPU"),
    (fake_torch(npu=True), "npu", "npu", "ASCEND_RT_VISIBLE_DEVICES", "hccl", "HCCL", "NPU"),
    (fake_torch(npu=False), "cpu", "cpu", None, "gloo", "Gloo", None),
    (fake_torch(), "cpu", "cpu", None, "gloo", "Gloo", None),
])
def test_the_platform_is_detected_and_names_its_variable_and_backend(fake, name, device_type, variable, backend,
                                                                      library, resource):
    p = device.detect(fake)
    assert (p.name, p.device_type, p.visible_devices, p.backend, p.collectives, p.ray_resource) == (
        name, device_type, variable, backend, library, resource)
    assert device.backend_for(device_type) == backend


def test_the_cpu_answers_without_an_accelerator():
    cpu = torch.device("cpu")
    assert not device.is_accelerator(cpu) and not device.is_accelerator("cpu")
    assert device.total_memory(cpu) is None and device.peak_memory(cpu) is None
    assert device.nvidia_capability(cpu) is None
    assert device.memory_allocated(cpu) == 0 and device.current_device("cpu") == cpu
    device.empty_cache(cpu), device.synchronize(cpu), device.reset_peak_memory(cpu), device.set_device(0, "cpu")
    with device.use_device(cpu):
        pass
    assert device.current_stream(cpu) is None and device.new_stream(cpu) is None     # streams: None, doing nothing
    assert device.record_event(None) is None
    device.wait_event(None, None), device.wait_stream(None, None)
    with device.stream_context(None):
        pass
    t = torch.arange(3)
    assert device.to_device(t, cpu) is t or torch.equal(device.to_device(t, cpu), t)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without a GPU")
def test_a_machine_without_gpus_runs_on_the_cpu():
    assert device.detect().name == "cpu" and device.default_device_type() == "cpu"
    assert not device.accelerator_available() and not device.pin_memory_available()
    assert device.device_count() == 0 and device.device_count("cuda") == 0
    assert device.rng_states() == {} and device.collectives_version() is None
    assert device.nvidia_capability("cuda") is None          # no NVIDIA GPU detected: no capability to report
    device.set_rng_states({"cuda": [torch.zeros(16, dtype=torch.uint8)]})     # a GPU run's state: nothing to set


def test_nothing_else_in_lathe_calls_torch_cuda():
    calls = [f"{path.relative_to(SRC)}:{i}: {line.strip()}" for path in SRC.rglob("*.py") if path.name != "device.py"
             or path.parent != SRC for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\btorch\.cuda\b", line.split("#", 1)[0])]
    assert not calls, "call lathe.device instead:\n" + "\n".join(calls)


def test_a_small_cpu_model_trains_on_one_thread_unless_the_user_chose(monkeypatch):
    from lathe.device import ONE_THREAD_PARAMS, cpu_threads, use_cpu_threads
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_threads(1_000) == 1 and cpu_threads(ONE_THREAD_PARAMS) is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = torch.nn.Linear(8, 8)
        assert use_cpu_threads(model, "cpu") is model and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        use_cpu_threads(model, "meta")                     # not a CPU run: torch's threads are left alone
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cpu_threads(1_000) is None
        use_cpu_threads(model, "cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_driver_of_ray_workers_keeps_a_few_threads_unless_the_user_chose(monkeypatch):
    from lathe.cluster import placement
    from lathe.cluster.placement import limit_driver_threads
    from lathe.device import DRIVER_THREADS
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(DRIVER_THREADS + 3)
        limit_driver_threads()
        assert torch.get_num_threads() == DRIVER_THREADS
        torch.set_num_threads(DRIVER_THREADS + 3)          # start_ray does it, also joining a Ray already started
        monkeypatch.setattr(placement, "require_ray", lambda: type("Ray", (), {"is_initialized": lambda: True}))
        assert placement.start_ray(None) is False and torch.get_num_threads() == DRIVER_THREADS
        torch.set_num_threads(1)                           # fewer already: left alone
        limit_driver_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", str(DRIVER_THREADS + 3))
        torch.set_num_threads(DRIVER_THREADS + 3)
        limit_driver_threads()
        assert torch.get_num_threads() == DRIVER_THREADS + 3
    finally:
        torch.set_num_threads(before)
