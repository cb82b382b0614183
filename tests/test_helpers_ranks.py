"""The multi-process tests' launcher (`helpers.run_processes`, `again_after_a_crash`): a rank that dies of a signal
makes the failure a `RankCrashed`, which the launchers run once more; any other failure fails at once."""

import multiprocessing
import os
import signal
import time

import pytest

from helpers import RankCrashed, again_after_a_crash, run_processes


def _rank(rank: int, queue, crash: bool) -> None:
    if crash and rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)          # as torch's gloo code has crashed under load
    time.sleep(0.2)
    queue.put((rank, "Traceback: connection reset by rank 0" if crash else rank * 10))


def _run(crash: bool) -> dict:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    return run_processes([ctx.Process(target=_rank, args=(r, queue, crash), daemon=True) for r in range(2)], queue,
                         timeout_s=30)


def test_a_rank_that_dies_of_a_signal_is_a_crash_and_runs_once_more():
    assert _run(False) == {0: 0, 1: 10}
    with pytest.raises(RankCrashed, match="died of SIGSEGV"):
        _run(True)
    crashes = iter([True, False])
    with pytest.warns(UserWarning, match="run once more"):
        assert again_after_a_crash(lambda: _run(next(crashes))) == {0: 0, 1: 10}
    with pytest.warns(UserWarning), pytest.raises(RankCrashed):       # a crash that comes back fails
        again_after_a_crash(lambda: _run(True))


def test_a_failure_without_a_signal_is_not_run_again():
    runs = []

    def fails():
        runs.append(1)
        raise AssertionError("rank 1 failed: a wrong value")
    with pytest.raises(AssertionError, match="wrong value"):
        again_after_a_crash(fails)
    assert len(runs) == 1
