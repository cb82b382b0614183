"""bench/decode_host.py's arithmetic on hand-made steps and events: the host's busy time is a step's wall time less
its wait, the device's graph time and idle gaps come from the events around each replay."""

import cProfile
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("bench_decode_host", ROOT / "bench" / "decode_host.py")
decode_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_host)


class Event:
    """A recorded CUDA event's stand-in: a time in ms."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, later: "Event") -> float:
        return later.ms - self.ms


def test_summary_separates_host_work_waits_device_time_and_gaps():
    # three decode graphs of 1.5 ms; the device idles 0.05 ms before the second and 0.3 ms before the third
    events = [(Event(0.0), Event(1.5)), (Event(1.55), Event(3.05)), (Event(3.35), Event(4.85))]
    steps = [{"wall": 0.020, "graph": False},                       # a prefill
             {"wall": 0.0016, "wait": 0.0010, "resolve": 0.0011, "graph": True},
             {"wall": 0.0020, "wait": 0.0002, "resolve": 0.0005, "graph": True},
             {"wall": 0.0012, "schedule": 0.0003, "graph": True}]
    row = decode_host.summarize(0.03, steps, events)
    assert row["decode_steps"] == 3 and row["other_steps_s"] == pytest.approx(0.020)
    assert row["device_graph_s"] == pytest.approx(4.5e-3)
    assert row["device_gap_s"] == pytest.approx(0.35e-3)
    assert row["gaps_over_100us"] == 1
    assert row["host_wait_s"] == pytest.approx(1.2e-3)
    assert row["host_busy_ms"][50] == pytest.approx(1.2)            # busy: 0.6, 1.8, 1.2 ms
    assert row["device_step_ms"][50] == pytest.approx(1.5)
    sections = row["host_sections_ms"]                              # resolve less its wait: 0.1, 0.3, 0 ms
    assert sections["resolve"] == pytest.approx(0.4 / 3) and sections["schedule"] == pytest.approx(0.1)
    assert sections["placeholders"] == 0


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def test_profile_rows_rank_functions_by_own_time_per_step():
    profiler = cProfile.Profile()
    for _ in range(4):              # four "steps", each calling _busy twice
        profiler.enable()
        _busy(20000)
        _busy(20000)
        profiler.disable()
    rows = decode_host.profile_rows(profiler, steps=4, top=50)
    busy = next(r for r in rows if r["function"].endswith("(_busy)"))
    assert busy["function"].startswith("test_bench_decode_host.py:") and busy["calls_per_step"] == 2
    assert busy["cumulative_ms_per_step"] >= busy["own_ms_per_step"] > 0
    own = [r["own_ms_per_step"] for r in rows]
    assert own == sorted(own, reverse=True) and len(decode_host.profile_rows(profiler, 4, top=1)) == 1
