"""lathe.track.progress: a live line on a terminal, plain timestamped lines elsewhere; the ETA arithmetic."""

from __future__ import annotations

import io
import logging
import re

import pytest

from lathe.track.backends import ConsoleLogger
from lathe.track.progress import (LIVE, LiveLineHandler, Once, Progress, duration, echo, eta_seconds, pace, phase,
                                  stamp)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_is_the_mean_pace_times_what_is_left():
    assert eta_seconds(2, 10, 4.0) == 16.0
    assert eta_seconds(10, 10, 20.0) == 0.0
    assert eta_seconds(0, 10, 3.0) is None and eta_seconds(3, None, 3.0) is None


def test_durations_and_paces_read_short():
    assert [duration(s) for s in (0.421, 8.14, 42.4, 185, 7620)] == ["0.42s", "8.1s", "42s", "3m05s", "2h07m"]
    assert pace(10, 2.0, "step") == "5.0 step/s" and pace(2, 5.0, "step") == "2.5s/step" and pace(0, 1.0, "step") == ""
    assert re.fullmatch(r"\d\d:\d\d:\d\d", stamp())


def test_on_a_terminal_one_line_is_redrawn_in_place_and_erased_at_the_end():
    term, clock = Terminal(), Clock()
    with Progress("warm start", 4, stream=term, tick_s=None, clock=clock) as bar:
        clock.now += 2.0
        bar.update(1, "loss 2.5")
        assert bar.text() == "warm start 1/4 25% | 2.0s/step | eta 6.0s | loss 2.5"
        clock.now += 1.0                              # the ETA counts down between updates
        assert bar.eta() == 5.0
        echo("12:00:00 step line", term)              # printed above the live line, which comes back below it
    out = term.getvalue()
    assert "\rwarm start 1/4 25% | 2.0s/step | eta 6.0s | loss 2.5" in out
    erased_then_line = re.search(r"\r +\r12:00:00 step line\n\rwarm start 1/4", out)
    assert erased_then_line, out
    assert out.endswith("\r") and "\x1b" not in out and not LIVE.owners


def test_in_a_log_no_carriage_return_and_a_line_every_every_s(caplog):
    plain, clock = io.StringIO(), Clock()
    with caplog.at_level(logging.INFO, logger="lathe"):
        with Progress("warm start", 80, stream=plain, every_s=30, tick_s=None, clock=clock) as bar:
            for i in range(1, 81):
                clock.now += 1.0
                bar.update(i, f"loss {1 / i:.2f}")
    assert plain.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["warm start 30/80 38% | 1.0s/step | eta 50s | loss 0.03",
                     "warm start 60/80 75% | 1.0s/step | eta 20s | loss 0.02"]
    assert not any("\r" in line or "\x1b" in line for line in lines)


def test_a_phase_in_a_log_announces_itself_when_slow_and_reports_its_time(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="lathe"):
        p = Progress("loading the policy x", announce_s=2.0, every_s=60.0, stream=io.StringIO(), tick_s=None,
                     clock=clock)
        clock.now += 1.0
        p.tick()                                      # quick so far: nothing
        clock.now += 1.5
        p.tick()
        clock.now += 30
        p.tick()                                      # the next line only after every_s
        p.close()
        with phase("saving", done="saved", report_s=0.0, stream=io.StringIO()):
            pass
        with phase("quick", stream=io.StringIO()):    # under report_s: nothing
            pass
        with pytest.raises(RuntimeError), phase("failing", report_s=0.0, stream=io.StringIO()):
            raise RuntimeError("no report for a phase that raised")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading the policy x ... 2.5s" and re.fullmatch(r"saved in \d\.\d\ds", lines[1]), lines
    assert len(lines) == 2


def test_phases_stack_over_the_training_line():
    term = Terminal()
    with Progress("train", 5, stream=term, tick_s=None) as bar:
        bar.update(1)
        with Progress("validating", stream=term, tick_s=None):
            assert [p.desc for p in LIVE.owners] == ["train", "validating"]
        assert LIVE.owners == [bar]
    out = term.getvalue()
    assert "\rvalidating ..." in out and "\rtrain 1/5 20%" in out[out.rindex("validating"):]


def test_log_handler_prints_above_the_live_line_and_once_drops_repeated_warnings(monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    logger = logging.getLogger("lathe.test_progress")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    handler = LiveLineHandler()
    handler.addFilter(Once())
    logger.addHandler(handler)
    try:
        with Progress("train", 5, tick_s=None) as bar:
            bar.update(1)
            for _ in range(3):
                logger.warning("the same warning from every rank")
            logger.warning("another one")
            logger.info("info lines are never dropped")
            logger.info("info lines are never dropped")
    finally:
        logger.removeHandler(handler)
    out = term.getvalue()
    assert out.count("the same warning from every rank\n") == 1 and "another one\n" in out
    assert out.count("info lines are never dropped\n") == 2
    assert re.search(r"\r +\rthe same warning from every rank\n\rtrain 1/5", out), out


def test_the_step_line_carries_a_timestamp_free_eta_from_the_resumed_step():
    got, clock = [], Clock()
    console = ConsoleLogger(10, got.append, clock=clock)
    console.truncate_after(4)                          # resumed at step 4: the pace counts from there ...
    clock.now += 100.0
    console.log({"val-core/x/reward/mean@1": 0.5}, 4)  # ... or from the validation before the first step
    clock.now += 6.0
    console.log({"critic/score/mean": 0.5}, 6)
    clock.now += 3.0
    console.log({"critic/score/mean": 0.5}, 10)        # the last step: no ETA
    assert got == ["step 4/10 | val[x] 0.5", "step 6/10 | score 0.5 | eta 12s", "step 10/10 | score 0.5"]


def test_a_forked_child_starts_without_the_parents_live_line():
    import os
    import threading
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    held, done = threading.Event(), threading.Event()

    def progress_thread():                            # holds the lock while the main thread forks
        with LIVE.lock:
            held.set()
            done.wait(10)

    with Progress("train", 5, stream=Terminal(), tick_s=None):
        holder = threading.Thread(target=progress_thread)
        holder.start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:                                  # the child: a fresh lock, no line to redraw
            os._exit(0 if LIVE.lock.acquire(timeout=2) and not LIVE.owners else 1)
        done.set()
        holder.join()
        assert os.waitpid(pid, 0)[1] == 0


def test_prints_from_other_threads_go_above_the_live_line_and_the_streams_come_back(monkeypatch):
    """Ray's worker-log thread and Python's warnings write to sys.stdout / sys.stderr on their own: while a live
    line is on the terminal those writes erase it first and it is drawn again below a finished line."""
    import sys
    import threading
    import warnings

    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    clock = Clock()
    with Progress("training", 10, tick_s=None, clock=clock) as bar:
        assert sys.stdout is not term and sys.stdout.raw is term and bar.stream is term
        bar.update(3, "score 0.5")
        worker = threading.Thread(target=lambda: print("(RankHost pid=7) a worker's log line"))
        worker.start()
        worker.join()
        sys.stderr.write(warnings.formatwarning("careful", UserWarning, "x.py", 1))   # what showwarning writes
        sys.stdout.write("half a line ")            # an unfinished line is not drawn over
        bar.update(4)
        sys.stdout.write("and its end\n")
    assert sys.stdout is term and sys.stderr is term and not LIVE.owners
    out = term.getvalue()
    rows = out.replace("\r", "\n").split("\n")
    assert "(RankHost pid=7) a worker's log line" in rows
    assert "half a line and its end" in rows
    assert any(r.startswith("x.py:1: UserWarning: careful") for r in rows)
    assert re.search(r"\r +\r\(RankHost pid=7\) a worker's log line\n\rtraining 3/10", out), out
