"""The one place that knows which accelerator lathe drives: discovery, the visible-devices variable, the collective
backend, memory and random-state queries, events, streams' synchronisation and graph capture. Nothing else in
lathe calls `torch.cuda` (tests/test_device.py checks it).

Platforms: `cuda` (NVIDIA), `rocm` (AMD through HIP: torch calls it "cuda" too, the library behind "nccl" is RCCL),
`npu` (Ascend through torch_npu: device type "npu", HCCL) and `cpu`. Only CUDA and CPU run on lathe's machines;
ROCm and NPU are told apart by the same code and tested with fakes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

GIB = 1024 ** 3


@dataclass(frozen=True)
class Platform:
    name: str                      # cuda | rocm | npu | cpu
    device_type: str               # torch's device type: cuda (CUDA and ROCm), npu, cpu
    visible_devices: str | None    # the variable that selects this process's devices
    backend: str                   # torch.distributed's backend name
    collectives: str               # the library behind it
    ray_resource: str | None       # Ray's resource name for one device


PLATFORMS = {
    "cuda": Platform("cuda", "cuda", "CUDA_VISIBLE_DEVICES", "nccl", "NCCL", "GPU"),
    "rocm": Platform("rocm", "cuda", "HIP_VISIBLE_DEVICES", "nccl", "RCCL", "GPU"),
    "npu": Platform("npu", "npu", "ASCEND_RT_VISIBLE_DEVICES", "hccl", "HCCL", "NPU"),
    "cpu": Platform("cpu", "cpu", None, "gloo", "Gloo", None),
}


def detect(torch_module: ModuleType = torch) -> Platform:
    """The accelerator this process can use: ROCm when torch is a HIP build, else CUDA; an Ascend NPU (torch_npu
    loaded); else the CPU."""
    if torch_module.cuda.is_available():
        return PLATFORMS["rocm" if getattr(torch_module.version, "hip", None) else "cuda"]
    npu = getattr(torch_module, "npu", None)
    if npu is not None and npu.is_available():
        return PLATFORMS["npu"]
    return PLATFORMS["cpu"]


def backend_for(device_type: str) -> str:
    """torch.distributed's backend for ranks on `device_type` devices (gloo on the CPU)."""
    return next((p.backend for p in PLATFORMS.values() if p.device_type == device_type), "gloo")


def _api(device: torch.device | str) -> ModuleType | None:
    """torch's module for `device`'s kind (torch.cuda, torch.npu), or None for the CPU."""
    kind = torch.device(device).type
    return getattr(torch, kind, None) if kind in ("cuda", "npu") else None


def device_api(device_type: str) -> ModuleType | None:
    """torch's module for a device type's streams and events (torch.cuda for "cuda"), or None for the CPU: for code
    that drives streams itself (lathe.train.offload), where the helpers below take None for the CPU."""
    return _api(device_type)


def is_accelerator(device: torch.device | str) -> bool:
    return _api(device) is not None


def accelerator_available() -> bool:
    return detect().device_type != "cpu"


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Below this size a CPU model's matmuls are too small to split over threads: a second thread only adds the cost of
# waking it, and on a machine running anything else each op waits for a thread that is not scheduled.
ONE_THREAD_PARAMS = 50_000_000


def cpu_threads(n_params: int) -> int | None:
    """Torch's intra-op threads for training a model of `n_params` on the CPU: one for a small model, None (torch's
    own choice) for a larger one or when the user chose with OMP_NUM_THREADS / MKL_NUM_THREADS."""
    if any(name in os.environ for name in THREAD_VARIABLES):
        return None
    return 1 if n_params < ONE_THREAD_PARAMS else None


def use_cpu_threads(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """On a CPU run, apply `cpu_threads` for `model` before anything computes (and say so); returns `model`."""
    if torch.device(device).type != "cpu":
        return model
    n_params = sum(p.numel() for p in model.parameters())
    threads = cpu_threads(n_params)
    if threads is not None and threads != torch.get_num_threads():
        logging.getLogger("lathe").info("cpu: %d torch thread(s) for a %.1fM-parameter model (more only wait on each "
                                        "other; set OMP_NUM_THREADS to choose)", threads, n_params / 1e6)
        torch.set_num_threads(threads)
    return model


# A driver of Ray workers only cuts and joins batches and runs the reward: a few threads do that. On 4 H200s (64
# cores) its index/cat took 4 ms a call against 30 us on 2 GPUs, about 0.5 s a 1.5B step; the likely cause (not yet
# confirmed by an A/B) is torch's default pool, one thread per core, waiting for threads the ranks' spinning ones
# deschedule.
DRIVER_THREADS = 4


def driver_threads() -> int | None:
    """Torch's intra-op threads for a process that drives workers (Ray ranks compute, it does not): at most
    `DRIVER_THREADS`; None when the user chose with OMP_NUM_THREADS / MKL_NUM_THREADS or torch already uses fewer."""
    if any(name in os.environ for name in THREAD_VARIABLES):
        return None
    return DRIVER_THREADS if torch.get_num_threads() > DRIVER_THREADS else None


def default_device_type() -> str:
    """`auto`: the accelerator when there is one, else the CPU."""
    return detect().device_type


def device_count(device_type: str | None = None) -> int:
    api = _api(device_type or default_device_type())
    return api.device_count() if api is not None and api.is_available() else 0


def current_device(device_type: str | None = None) -> torch.device:
    """This process's current accelerator (its index made explicit), or the CPU."""
    kind = device_type or default_device_type()
    api = _api(kind)
    return torch.device(kind, api.current_device()) if api is not None else torch.device("cpu")


def rank_device(device_type: str) -> torch.device:
    """The device of a Ray worker rank: the one accelerator Ray made visible to it (index 0), or the CPU."""
    return torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")


def set_device(index: int, device_type: str | None = None) -> None:
    api = _api(device_type or default_device_type())
    if api is not None:
        api.set_device(index)


def use_device(device: torch.device | str):
    """A context in which `device` is the current accelerator (nothing on the CPU)."""
    api = _api(device)
    return api.device(torch.device(device)) if api is not None else contextlib.nullcontext()


def properties(index: int, device_type: str | None = None) -> dict:
    """Name, memory (bytes), compute capability and multiprocessor count of accelerator `index`."""
    p = _api(device_type or default_device_type()).get_device_properties(index)
    return {"name": p.name, "total_memory": p.total_memory, "capability": f"{p.major}.{p.minor}",
            "multiprocessors": getattr(p, "multi_processor_count", None)}


def collectives_version() -> str | None:
    """The version of NCCL (RCCL on ROCm) torch was built with, or None."""
    if detect().backend != "nccl":
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:                                   # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def multiprocessor_count(device: torch.device | str) -> int:
    device = torch.device(device)
    return _api(device).get_device_properties(device).multi_processor_count


def nvidia_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) compute capability of an NVIDIA GPU; None for the CPU and other accelerators (ROCm reports its
    own numbering through the same call)."""
    device = torch.device(device)
    if device.type != "cuda" or detect().name != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    return p.major, p.minor


def nvidia_uuid(device: torch.device | str) -> str | None:
    """NVML's name of an NVIDIA GPU (`GPU-<uuid>`, or a MIG instance's `MIG-...`); None for the CPU and other
    accelerators, or a device that reports none."""
    device = torch.device(device)
    if device.type != "cuda" or detect().name != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def total_memory(device: torch.device | str) -> int | None:
    """Bytes of memory on `device`, or None for the CPU (host memory is not planned)."""
    api = _api(device)
    return None if api is None else api.get_device_properties(torch.device(device)).total_memory


def memory_info(device: torch.device | str) -> tuple[int, int]:
    """(free, total) bytes on the accelerator `device`."""
    return _api(device).mem_get_info(torch.device(device))


# Device memory lathe maps itself, outside PyTorch's allocator (the engine's KV cache: `lathe.engine.vmm`), by device
# index: [bytes mapped now, the most mapped since the last `reset_peak_memory`]. The figures below count it as
# allocated and reserved, as they counted the cache when it was a tensor.
_MAPPED: dict[int, list[int]] = {}


def _index(device: torch.device | str) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def count_mapped(device: torch.device | str, nbytes: int) -> None:
    """`nbytes` more (or, negative, fewer) bytes mapped outside PyTorch's allocator on `device`."""
    now = _MAPPED.setdefault(_index(device), [0, 0])
    now[0] += nbytes
    now[1] = max(now[1], now[0])


def _mapped(device: torch.device | str, peak: bool = False) -> int:
    if torch.device(device).type != "cuda" or not _MAPPED:
        return 0
    return _MAPPED.get(_index(device), [0, 0])[int(peak)]


def memory_allocated(device: torch.device | str) -> int:
    """Bytes allocated on `device`: PyTorch's allocator's and lathe's own mappings (`count_mapped`), 0 on the CPU."""
    api = _api(device)
    return 0 if api is None else api.memory_allocated(torch.device(device)) + _mapped(device)


def memory_reserved(device: torch.device | str) -> int:
    """Bytes PyTorch's caching allocator holds on `device` (allocated or cached) and lathe's own mappings, 0 on the
    CPU."""
    api = _api(device)
    return 0 if api is None else api.memory_reserved(torch.device(device)) + _mapped(device)


def reset_peak_memory(device: torch.device | str) -> None:
    api = _api(device)
    if api is not None:
        api.reset_peak_memory_stats(torch.device(device))
        if torch.device(device).type == "cuda" and _MAPPED:
            now = _MAPPED.setdefault(_index(device), [0, 0])
            now[1] = now[0]


def peak_memory(device: torch.device | str) -> tuple[int, int] | None:
    """(peak allocated, peak reserved) bytes since the last `reset_peak_memory` (lathe's own mappings added at
    their peak), or None on the CPU."""
    api = _api(device)
    if api is None:
        return None
    device, mapped = torch.device(device), _mapped(device, peak=True)
    return api.max_memory_allocated(device) + mapped, api.max_memory_reserved(device) + mapped


def record_memory_history(device: torch.device | str, *, max_entries: int, context: str = "all",
                          stacks: str = "all", **extra) -> None:
    """Start recording `device`'s allocator events (each allocation and free with its stack; the last
    `max_entries` kept) for `dump_memory_snapshot` (`global_profiler.tool=torch_memory`). CUDA only: the CPU has no
    caching allocator to record."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"memory-allocation history needs a CUDA device, not {torch.device(device).type}")
    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks=stacks,
                                             max_entries=max_entries, device=torch.device(device), **extra)


def stop_memory_history(device: torch.device | str) -> None:
    """Stop recording (and drop the recorded events): `record_memory_history` undone."""
    torch.cuda.memory._record_memory_history(enabled=None, device=torch.device(device))


def dump_memory_snapshot(device: torch.device | str, path: str) -> None:
    """Write the allocator's snapshot (its segments and blocks now, and the recorded events) as a pickle to `path`,
    after `device`'s queued work; pytorch.org/memory_viz draws it."""
    synchronize(device)
    torch.cuda.memory._dump_snapshot(path)


def clear_blas_workspaces(device: torch.device | str) -> None:
    """Free cuBLAS's workspaces (one per handle and stream, 32 MiB each on Hopper, made through PyTorch's allocator at
    a handle's first product, and kept): made where the allocator finds room, inside a large cached segment, such a
    workspace keeps the whole segment from going back to the driver (the backward thread's, made at the first update
    inside the sleeping engine's cached KV cache, held 62 GiB of an H200 so). The next product makes one again. Safe
    for lathe's decode graphs: their captures make their own inside the graphs' pool (`DecodeGraphs._capture_once`)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)     # (absent from a CPU build)
    if torch.device(device).type == "cuda" and clear is not None:
        clear()


def empty_cache(device: torch.device | str) -> None:
    """Return the allocator's cached blocks to the device (nothing to do on the CPU)."""
    api = _api(device)
    if api is not None:
        api.empty_cache()


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    api = _api(device)
    if api is not None:
        api.synchronize(torch.device(device))


def new_event(device: torch.device | str, *, timing: bool = False):
    """An event on `device`'s current stream, to record and wait on (accelerators only)."""
    return _api(device).Event(enable_timing=timing)


# -- streams (copies overlapping the compute stream's work) ------------------------------------------------------
# On the CPU a stream is None and every helper does nothing: work runs in program order there, so code written for
# side streams runs unchanged.
def current_stream(device: torch.device | str):
    """`device`'s current stream (the compute stream), or None on the CPU."""
    api = _api(device)
    return None if api is None else api.current_stream(torch.device(device))


def new_stream(device: torch.device | str):
    """A side stream on `device` (taken from torch's pool of streams), or None on the CPU."""
    api = _api(device)
    return None if api is None else api.Stream(device=torch.device(device))


def stream_context(stream):
    """The context in which work is queued on `stream` (nothing changes for None)."""
    return contextlib.nullcontext() if stream is None else _api(stream.device).stream(stream)


def record_event(stream, *, timing: bool = False):
    """An event recorded now on `stream`: it completes once the work queued there so far has run (None for None)."""
    if stream is None:
        return None
    event = new_event(stream.device, timing=timing)
    event.record(stream)
    return event


def wait_event(stream, event) -> None:
    """Work queued on `stream` from now on waits for `event` on the device (the host does not wait)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def wait_stream(stream, other) -> None:
    """Work queued on `stream` from now on waits for the work queued on `other` so far (on the device)."""
    if stream is not None and other is not None:
        stream.wait_stream(other)


def pin_memory_available() -> bool:
    """Whether host tensors can be page-locked (there is an accelerator to copy them to)."""
    return accelerator_available()


class Staging:
    """A host buffer that one kind of host-to-device copy reuses at every step: page-locked on an accelerator, so
    the copy neither waits for the stream's queued work (as a copy from pageable memory may) nor pins new memory
    each time (`to_device` does: tens of microseconds usually, but milliseconds when the caching host allocator
    has no free block of the size, as a 2 MB block-table update met every 16th decode step). `writable()` first waits
    for the copy that last read the buffer (normally long done), so the host never rewrites bytes a queued copy
    has not read yet. On the CPU: a plain tensor, copied at once."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.device = torch.device(device)
        self.tensor = torch.zeros(shape, dtype=dtype, pin_memory=is_accelerator(self.device))
        self.event = None

    def writable(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensor

    def copy_to(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), `src` a view of this buffer, without waiting for the device."""
        dst.copy_(src, non_blocking=True)
        if is_accelerator(self.device):
            self.event = new_event(self.device)
            self.event.record()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: accelerator copies go through pinned memory (a
    copy from pageable memory may wait for the stream's queued work, which would stall the engine's overlap)."""
    if not is_accelerator(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def array_to_device(a, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host (numpy) array on `device` as `dtype`, without waiting for the device (`to_device`)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(a)).to(dtype), device)


# -- graphs (the engine's decode steps) --------------------------------------------------------------------
def new_graph(device: torch.device | str):
    """An empty graph to capture into (CUDA and ROCm: CUDAGraph / HIP graphs)."""
    return _api(device).CUDAGraph()


def graph_pool(device: torch.device | str):
    """A memory pool the graphs of one engine share."""
    return _api(device).graph_pool_handle()


def capture(graph, device: torch.device | str, pool=None):
    """The context that records the work issued inside it into `graph`."""
    return _api(device).graph(graph, pool=pool)


def capturing(device: torch.device | str) -> bool:
    """Whether a graph is being captured on `device`'s current stream (nothing may be read on the host then)."""
    api = _api(device)
    return api is not None and bool(getattr(api, "is_current_stream_capturing", lambda: False)())


# -- random state (checkpoints) ----------------------------------------------------------------------------
def rng_states() -> dict[str, list[torch.Tensor]]:
    """Every accelerator's random-generator state, by torch device type ({} on the CPU)."""
    platform = detect()
    api = _api(platform.device_type)
    return {} if api is None else {platform.device_type: api.get_rng_state_all()}


def set_rng_states(states: dict[str, list[torch.Tensor]]) -> None:
    """Restore what `rng_states` saved, for the device types present here."""
    for kind, state in states.items():
        api = _api(kind)
        if api is not None and api.is_available():
            api.set_rng_state_all(state)
