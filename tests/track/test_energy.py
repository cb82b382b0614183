"""Energy and power per phase (`lathe.track.energy`): the meter's arithmetic on a counter and clock of our own, its
place in `Timer`, and on an NVIDIA GPU the driver's real counter."""

import pytest
import torch

from lathe.track import Timer
from lathe.track.energy import MIN_POWER_S, DeviceEnergy


class Counter:
    """A device's energy counter (mJ) and a clock (s) that the test advances together: `watts` while time passes."""

    def __init__(self):
        self.mj, self.s = 1_000_000, 100.0

    def run(self, seconds: float, watts: float) -> None:
        self.s += seconds
        self.mj += round(watts * seconds * 1000)


def test_phases_get_their_joules_and_long_ones_their_power():
    c = Counter()
    meter = DeviceEnergy(lambda: c.mj, power_limit_w=700.0, clock=lambda: c.s)
    timer = Timer(clock=lambda: c.s, energy=meter)
    with timer("step"):
        with timer("gen"):
            c.run(1.0, 500.0)
        with timer("update_actor"):
            c.run(2.0, 690.0)
        with timer("adv"):                  # too short for a power figure
            c.run(MIN_POWER_S / 10, 300.0)
        with timer("gen"):                  # a phase timed twice adds up
            c.run(0.5, 400.0)
    m = timer.metrics()
    assert m["perf/energy_j/gen"] == pytest.approx(700.0) and m["perf/power_w/gen"] == pytest.approx(700 / 1.5)
    assert m["perf/energy_j/update_actor"] == pytest.approx(1380.0) and m["perf/power_w/update_actor"] == 690.0
    adv = 300.0 * MIN_POWER_S / 10
    assert m["perf/energy_j/adv"] == pytest.approx(adv, abs=1e-3) and "perf/power_w/adv" not in m
    assert m["perf/energy_j/step"] == pytest.approx(700 + 1380 + adv, abs=1e-3)
    assert m["perf/power_limit_w"] == 700.0 and m["timing_s/update_actor"] == pytest.approx(2.0)
    timer.reset()
    assert timer.metrics() == {}
    with timer("gen"):
        c.run(1.0, 600.0)
    again = Timer(clock=lambda: c.s, energy=meter)       # the next step's timer: the meter starts afresh
    with again("gen"):
        c.run(1.0, 650.0)
    assert again.metrics()["perf/power_w/gen"] == pytest.approx(650.0)


def test_a_counter_that_fails_or_goes_back_reports_nothing():
    values = iter([5000, None, 9000, 100])
    meter = DeviceEnergy(lambda: next(values), power_limit_w=700.0)
    for _ in range(2):
        meter.start("gen")
        meter.stop("gen")
    assert meter.metrics() == {}            # no limit alone either: nothing was measured


def test_no_meter_without_a_device_counter():
    assert DeviceEnergy.open(torch.device("cpu")) is None


@pytest.mark.gpu
def test_the_driver_counter_on_cuda():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    meter = DeviceEnergy.open(torch.device("cuda"))
    assert meter is not None, "NVML did not give this device's energy counter"
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    timer = Timer(energy=meter)
    with timer("matmuls"):                  # ~1 s of products at a few hundred TFLOP/s
        for _ in range(4000):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    m = timer.metrics()
    assert m["timing_s/matmuls"] >= MIN_POWER_S, "the work was too short to measure power"
    assert 30 < m["perf/power_w/matmuls"] < m["perf/power_limit_w"] * 1.5


def test_several_gpus_sum():
    a, b = Counter(), Counter()
    meter = DeviceEnergy.summed([lambda: a.mj, lambda: b.mj], [700.0, 700.0])
    meter.clock = lambda: a.s
    timer = Timer(clock=lambda: a.s, energy=meter)
    with timer("update_actor"):
        a.run(2.0, 690.0)
        b.mj += round(2.0 * 650.0 * 1000)
    m = timer.metrics()
    assert m["perf/power_w/update_actor"] == pytest.approx(1340.0) and m["perf/power_limit_w"] == 1400.0
    assert m["perf/energy_gpus"] == 2.0
    failing = DeviceEnergy.summed([lambda: a.mj, lambda: None], [700.0, None])
    failing.start("gen")
    failing.stop("gen")
    assert failing.metrics() == {} and failing.limit is None


def test_a_ray_runs_gpus_are_read_where_all_are_on_the_drivers_node(monkeypatch):
    import sys
    import types

    from lathe.track import energy

    class Group:
        def __init__(self, *nodes):
            self.nodes = [{"node_id": n, "gpu_uuid": u} for n, u in nodes]

    context = types.SimpleNamespace(get_node_id=lambda: "here")
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get_runtime_context=lambda: context))
    opened = []
    monkeypatch.setattr(energy.DeviceEnergy, "open_uuids", classmethod(lambda cls, uuids: opened.append(uuids) or
                                                                       "meter"))
    assert energy.for_cluster([Group(("here", None), ("here", None))]) is None          # CPU workers
    assert energy.for_cluster([Group(("here", "GPU-a"), ("there", "GPU-b"))]) is None   # a rank on another node
    assert energy.for_cluster([Group(("here", "GPU-a"), ("here", "GPU-b")), Group(("here", "GPU-c"))]) == "meter"
    assert opened == [["GPU-a", "GPU-b", "GPU-c"]]
