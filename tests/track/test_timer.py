import pytest

from lathe.track.timer import Timer


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_accumulates_and_nests():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer("step"):
        with timer("gen"):
            clock.t += 2.0
        with timer("gen"):  # same phase twice in one step adds up
            clock.t += 1.0
        clock.t += 0.5
    assert timer.metrics() == {"timing_s/step": 3.5, "timing_s/gen": 3.0}


def test_per_token_ms_and_reset():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer("gen"):
        clock.t += 0.5
    out = timer.metrics(num_tokens={"gen": 250, "update_actor": 100, "ref": 0})
    assert out["timing_per_token_ms/gen"] == pytest.approx(2.0)
    assert "timing_per_token_ms/update_actor" not in out  # never timed
    timer.reset()
    assert timer.metrics() == {}


def test_reentering_open_name_is_refused_and_exception_still_counts():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with pytest.raises(RuntimeError, match="already being timed"):
        with timer("gen"):
            with timer("gen"):
                pass
    with pytest.raises(ValueError):
        with timer("adv"):
            clock.t += 1.0
            raise ValueError("boom")
    assert timer.seconds["adv"] == 1.0
    with timer("gen"):  # usable again after the failure
        pass


def test_real_clock_measures_sleep():
    import time

    timer = Timer()
    with timer("sleep"):
        time.sleep(0.02)
    assert 0.015 < timer.metrics()["timing_s/sleep"] < 1.0


def test_a_memory_tracker_sees_every_phase_and_its_metrics_join_the_timings():
    from lathe.track.memory import PeakMemory
    seen = []

    class Fake(PeakMemory):
        def start(self, name):
            seen.append(("start", name))

        def stop(self, name):
            seen.append(("stop", name))
            self.gb[name] = {"gen": (3.0, 4.0), "update_actor": (7.5, 9.0)}[name]

    timer = Timer(memory=Fake("cuda"))
    with timer("gen"):
        pass
    with timer("update_actor"):
        pass
    m = timer.metrics()
    assert seen == [("start", "gen"), ("stop", "gen"), ("start", "update_actor"), ("stop", "update_actor")]
    assert m["perf/max_memory_allocated_gb/gen"] == 3.0 and m["perf/max_memory_reserved_gb/update_actor"] == 9.0
    assert m["perf/max_memory_allocated_gb"] == 7.5 and m["perf/max_memory_reserved_gb"] == 9.0
    timer.reset()
    assert not any(k.startswith("perf/") for k in timer.metrics())


def test_peak_memory_reports_nothing_on_a_cpu():
    from lathe.track.memory import PeakMemory
    timer = Timer(memory=PeakMemory("cpu"))
    with timer("gen"):
        pass
    assert set(timer.metrics()) == {"timing_s/gen"}
