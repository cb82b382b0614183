"""Energy and power per phase of a step, from the GPU's own energy counter (NVML).

`DeviceEnergy` hooks into `Timer` as `PeakMemory` does (`Timer(energy=DeviceEnergy.open(device))`): each timed
phase reads the device's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`, millijoules since the driver
loaded) when it starts and when it ends, giving

- `perf/energy_j/<phase>`: joules the device drew over the phase's wall time (the window `timing_s/<phase>`
  measures, so a phase whose work the device finishes after it ends counts as its time does);
- `perf/power_w/<phase>`: those joules over the phase's seconds, for phases of at least `MIN_POWER_S`. The counter
  advances in steps (every ~100 ms on an H200, measured: `bench/results/energy_counter_nvidia-h200.json`), so a phase's
  joules are those of a window shifted by up to a step at either end: its power is good to about 0.1 s over its
  duration (20% at `MIN_POWER_S`, 2% for a 5 s update), its median over steps better;
- `perf/power_limit_w`: the device's enforced power limit. A phase that averages near it runs power-capped: its
  clock is what the cap leaves, and it goes faster only by drawing less energy (fewer FLOPs, fewer bytes), not by
  filling idle time (issue 48: a 1.5B GRPO step on an H200 averaged ~700 W of 700 in every phase).

A Ray run's driver holds no device: it reads the GPUs of its worker groups' ranks (`for_cluster`, each rank's GPU
named by its UUID, `RankHost.node`), summed: joules and watts of all of them, `perf/power_limit_w` the sum of their
limits and `perf/energy_gpus` their count. NVML reads only the GPUs of its own machine, so a run with ranks on
other nodes reports no energy. The devices' whole draw is counted, another process's work on them included. NVML is
read through the driver's own library (`libnvidia-ml.so.1`, no Python package); `open` returns None on a CPU, where
the library or the counter is missing, or where it cannot tell which NVML device the CUDA device is: the metrics
are then simply absent.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable

MIN_POWER_S = 0.5


class _Nvml:
    """The few NVML calls used here, on one device handle."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def energy_mj(self) -> int | None:
        value = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) != 0:
            return None
        return value.value

    def power_limit_w(self) -> float | None:
        value = ctypes.c_uint()
        if self.lib.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(value)) != 0:
            return None
        return value.value / 1000.0


@functools.lru_cache(maxsize=None)
def _nvml_for(uuid: str) -> _Nvml | None:
    """NVML's handle of the device with this UUID (`GPU-...`), or None where NVML or the device is not there."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByUUID(uuid.encode("ascii"), ctypes.byref(handle)) != 0:
        return None
    nvml = _Nvml(lib, handle)
    return nvml if nvml.energy_mj() is not None else None


class DeviceEnergy:
    """Accumulates joules (and seconds) per phase until `reset()`; `read_mj` gives the devices' energy counter (the
    sum of `devices` devices')."""

    def __init__(self, read_mj: Callable[[], int | None], power_limit_w: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, devices: int = 1):
        self.read_mj, self.limit, self.clock, self.devices = read_mj, power_limit_w, clock, devices
        self.joules: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self._started: dict[str, tuple[int, float]] = {}

    @classmethod
    def open(cls, device) -> DeviceEnergy | None:
        """The meter of `device` (a torch device), or None where NVML cannot read its energy."""
        from lathe.device import nvidia_uuid          # (lathe.track stays free of torch until a meter is opened)
        uuid = nvidia_uuid(device)
        return cls.open_uuids([uuid]) if uuid else None

    @classmethod
    def open_uuids(cls, uuids: list[str]) -> DeviceEnergy | None:
        """One meter over the GPUs named (NVML's `GPU-...` UUIDs, each once), or None where NVML cannot read one."""
        nvmls = [_nvml_for(u) for u in dict.fromkeys(uuids)]
        if not nvmls or any(n is None for n in nvmls):
            return None
        return cls.summed([n.energy_mj for n in nvmls], [n.power_limit_w() for n in nvmls])

    @classmethod
    def summed(cls, readers: list[Callable[[], int | None]], limits: list[float | None]) -> DeviceEnergy:
        """A meter over several counters: their sum (None when one fails), the limits' sum (None if one is)."""
        def read() -> int | None:
            values = [r() for r in readers]
            return None if any(v is None for v in values) else sum(values)
        limit = None if any(w is None for w in limits) else sum(limits)
        return cls(read, limit, devices=len(readers))

    def start(self, name: str) -> None:
        mj = self.read_mj()
        if mj is not None:
            self._started[name] = (mj, self.clock())

    def stop(self, name: str) -> None:
        started, mj = self._started.pop(name, None), self.read_mj()
        if started is None or mj is None or mj < started[0]:
            return
        self.joules[name] = self.joules.get(name, 0.0) + (mj - started[0]) / 1000.0
        self.seconds[name] = self.seconds.get(name, 0.0) + (self.clock() - started[1])

    def metrics(self) -> dict[str, float]:
        out = {f"perf/energy_j/{name}": j for name, j in self.joules.items()}
        out.update({f"perf/power_w/{name}": j / self.seconds[name] for name, j in self.joules.items()
                    if self.seconds[name] >= MIN_POWER_S})
        if out and self.limit:
            out["perf/power_limit_w"] = self.limit
        if out and self.devices > 1:
            out["perf/energy_gpus"] = float(self.devices)
        return out

    def reset(self) -> None:
        self.joules.clear()
        self.seconds.clear()
        self._started.clear()


def for_cluster(groups: list) -> DeviceEnergy | None:
    """The meter over a Ray run's GPUs, read by its driver: the GPUs its worker groups' ranks hold (`RankHost.node`'s
    `gpu_uuid`), or None where the ranks hold none (CPU workers), where one is on another node (NVML reads the
    local machine only), or where NVML cannot read them."""
    nodes = [n for g in groups for n in (getattr(g, "nodes", None) or [])]
    uuids = [n["gpu_uuid"] for n in nodes if n.get("gpu_uuid")]
    if not uuids:
        return None
    import ray
    here = ray.get_runtime_context().get_node_id()
    if any(n.get("node_id") != here for n in nodes if n.get("gpu_uuid")):
        return None
    return DeviceEnergy.open_uuids(uuids)
