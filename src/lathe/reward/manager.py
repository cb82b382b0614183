"""RewardManager: score a batch of responses so that no sample can break or stall a run.

A reward function that raises, returns garbage, crashes its process or never returns costs
only the sample it was scoring: that sample gets 0.0, the event is counted
(``reward/num_errors``, ``reward/num_timeouts``) and the first one of each ``score()`` call
is logged on the ``lathe.reward`` logger. Everything else is scored normally. A function that fails
wholesale (most samples, several calls in a row) stops the run with its first error.

Timeouts need a process that can be killed, so with ``timeout_s > 0`` samples are scored in
worker processes forked from this one (see :mod:`lathe.reward.workers`); the workers
inherit the already-loaded function, so nothing but items and results is pickled. A worker
that hangs is killed with its whole process group and replaced. ``timeout_s <= 0`` scores
in this process, with no timeout.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import threading
import weakref
from collections import deque
from multiprocessing.connection import wait
from time import monotonic
from typing import Any, Callable

from lathe.reward.scoring import ScoreResult, describe_fn, score_one
from lathe.reward.workers import Worker

__all__ = ["RewardManager", "RewardFunctionFailing", "ScoreResult"]

logger = logging.getLogger("lathe.reward")

REQUIRED_KEYS = ("data_source", "solution_str", "ground_truth")
_MAX_CHUNK = 32  # samples sent to a worker at once: one pipe round trip per chunk
_TIMEOUT = ("timeout",)  # raw result of a sample whose worker was killed for taking too long


def _shorten(text: Any, head: int = 60, tail: int = 140) -> str:
    """Keep the start and the (answer-bearing) end of a long response for a log line."""
    text = str(text)
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


class RewardFunctionFailing(RuntimeError):
    """The reward function failed on most samples in several scoring calls in a row."""


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Kill every manager's workers at interpreter exit."""
    for manager in list(_LIVE):
        manager.close()


class RewardManager:
    """Scores batches of ``{"data_source", "solution_str", "ground_truth", "extra_info"}``.

    ``compute_score`` has verl's signature ``fn(data_source, solution_str, ground_truth,
    extra_info=None) -> float | dict`` (see :func:`lathe.reward.custom.load_reward_fn`).
    ``timeout_s`` bounds each sample (``<= 0``: score in-process, no timeout);
    ``num_workers`` forked processes score in parallel (in-process mode uses none). The
    first error and the first timeout of EACH ``score()`` call are logged (so a new kind
    of failure later in a run still shows up); all are counted in :meth:`metrics`.
    Workers start on the first ``score()`` and live until :meth:`close` (also run at exit).
    """

    def __init__(self, compute_score: Callable, *, timeout_s: float = 10.0, num_workers: int = 1,
                 max_failure_fraction: float = 0.5, max_failing_calls: int = 3):
        """A call where more than `max_failure_fraction` of the samples fail (errors and timeouts) is a failing
        call; `max_failing_calls` of them in a row raise `RewardFunctionFailing` with the first error of the first
        one (0: never). Isolated failures cost only their samples."""
        if not callable(compute_score):
            raise TypeError(f"RewardManager: compute_score={compute_score!r:.80} is not callable")
        if num_workers < 1:
            raise ValueError(f"RewardManager: num_workers={num_workers} must be >= 1")
        self.compute_score = compute_score
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self._fn_desc = describe_fn(compute_score)
        self._workers: list[Worker] = []
        self._counts = {"reward/num_errors": 0, "reward/num_timeouts": 0}
        self.max_failure_fraction, self.max_failing_calls = float(max_failure_fraction), int(max_failing_calls)
        self._failing: list[str] = []        # one line per failing call of the current streak
        self._warned_dropped: set[str] = set()
        self._lock = threading.Lock()  # one batch at a time: workers hold per-batch state
        if self.timeout_s > 0 and "fork" not in multiprocessing.get_all_start_methods():
            logger.warning("RewardManager: this platform cannot fork; scoring in-process without timeouts")
            self.timeout_s = 0.0
        _LIVE.add(self)

    # ---- public API -------------------------------------------------------------------

    def score(self, items: list[dict]) -> list[ScoreResult]:
        """Score every item; results come back in input order."""
        _check_items(items)
        if not items:
            return []
        with self._lock:
            raw = self._score_raw(items)
            results = [self._to_result(r) for r in raw]
            self._report(items, raw, results)
            self._check_streak(items, raw, results)
        return results

    def _score_raw(self, items: list[dict]) -> list[tuple]:
        """Each item's raw result tuple (see :func:`score_one`), in input order."""
        if self.timeout_s <= 0:
            return [score_one(self.compute_score, item, i, self._fn_desc) for i, item in enumerate(items)]
        return self._score_in_workers(items)

    def _check_streak(self, items: list[dict], raw: list, results: list[ScoreResult]) -> None:
        failed = [i for i, r in enumerate(results) if r.error is not None]
        if len(failed) <= self.max_failure_fraction * len(results):
            self._failing = []
            return
        i = failed[0]
        tb = raw[i][4] if raw[i] is not _TIMEOUT and len(raw[i]) == 5 else ""
        self._failing.append(f"{len(failed)} of {len(results)} samples failed; the first, sample {i} "
                             f"(data_source={items[i]['data_source']!r}): {results[i].error}"
                             + (f"\n{tb.rstrip()}" if tb else ""))
        if 0 < self.max_failing_calls <= len(self._failing):
            raise RewardFunctionFailing(
                f"reward function {self._fn_desc} failed on more than {self.max_failure_fraction:.0%} of the samples "
                f"in {len(self._failing)} scoring calls in a row, so the run stops instead of training on zero "
                f"rewards. First failing call: {self._failing[0]}\nFix the function (or raise "
                f"reward.max_failure_fraction / reward.max_failing_calls; 0 calls = never stop).")

    @property
    def name(self) -> str:
        """The reward function's short name (for messages)."""
        return self._fn_desc

    def start(self) -> None:
        """Fork the worker processes now (they start on the first ``score()`` otherwise): from the driver's thread,
        before a background thread scores with them."""
        with self._lock:
            while self.timeout_s > 0 and len(self._workers) < self.num_workers:
                self._workers.append(self._new_worker())

    def metrics(self) -> dict[str, int]:
        """Error and timeout counts since the previous call, then reset."""
        out = dict(self._counts)
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for debugging and tests)."""
        return [w.pid for w in self._workers]

    def close(self) -> None:
        """Kill the workers (they restart on the next ``score()``). Safe to call twice."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass

    # ---- worker scheduling -------------------------------------------------------------

    def _score_in_workers(self, items: list[dict]) -> list[tuple]:
        """Feed chunks to idle workers; kill and replace hung or dead ones."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())
        raw: list[tuple | None] = [None] * len(items)
        todo = deque(range(len(items)))
        chunk = max(1, min(_MAX_CHUNK, -(-len(items) // (4 * self.num_workers))))
        try:
            while todo or any(w.pending for w in self._workers):
                for slot, worker in enumerate(self._workers):
                    if not worker.pending and todo:
                        self._send(slot, [todo.popleft() for _ in range(min(chunk, len(todo)))], items, raw, todo)
                self._collect(raw, todo)
        except BaseException:
            self.close()  # workers hold half-done chunks: start clean next time
            raise
        return raw

    def _send(self, slot: int, indices: list[int], items: list[dict], raw: list, todo: deque) -> None:
        """Send a chunk; an item that cannot be pickled fails alone, a dead worker is replaced."""
        try:
            self._workers[slot].send(indices, items)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            self._replace(slot)
            todo.extendleft(reversed(indices))
        except Exception as exc:  # pickling failed before anything was written
            bad = [i for i in indices if not _picklable(items[i])] or indices
            for i in bad:
                raw[i] = (0.0, {}, f"sample {i} could not be sent to a reward worker ({type(exc).__name__}: "
                          f"{exc}); its fields and extra_info must be picklable", [], None)
            todo.extendleft(reversed([i for i in indices if i not in bad]))

    def _collect(self, raw: list, todo: deque) -> None:
        """Wait for results until the oldest running sample's deadline; handle deaths and hangs."""
        busy = {w.conn: slot for slot, w in enumerate(self._workers) if w.pending}
        if not busy:
            return
        deadline = min(self._workers[s].started for s in busy.values()) + self.timeout_s
        for conn in wait(list(busy), timeout=max(0.0, deadline - monotonic())):
            slot = busy[conn]
            worker = self._workers[slot]
            try:
                worker.drain(raw)
            except (EOFError, OSError):
                code = worker.exitcode()
                index = worker.pending[0]
                raw[index] = (0.0, {}, f"reward worker died (exit code {code}) while scoring sample {index}", [], None)
                todo.extendleft(reversed(list(worker.pending)[1:]))
                self._replace(slot)
        now = monotonic()
        for slot in busy.values():
            worker = self._workers[slot]
            if worker.pending and now - worker.started > self.timeout_s:
                raw[worker.pending[0]] = _TIMEOUT
                todo.extendleft(reversed(list(worker.pending)[1:]))
                self._replace(slot)

    def _replace(self, slot: int) -> None:
        """Kill the worker in ``slot`` (and its process group) and fork a fresh one."""
        self._workers[slot].kill()
        self._workers[slot] = self._new_worker()

    def _new_worker(self) -> Worker:
        """A forked process that scores one sample per item (:func:`score_one`)."""
        return Worker(self.compute_score, self._fn_desc)

    # ---- results and reporting -----------------------------------------------------------

    def _to_result(self, r: tuple) -> ScoreResult:
        if r is _TIMEOUT:
            return ScoreResult(0.0, {}, f"timed out after {self.timeout_s:g} s", timed_out=True)
        score, extra, error, _dropped, _tb = r
        return ScoreResult(score, extra, error, False)

    def _report(self, items: list[dict], raw: list[tuple], results: list[ScoreResult]) -> None:
        """Count errors/timeouts, log the first of each for this call, warn on dropped extras."""
        errors = [i for i, r in enumerate(results) if r.error is not None and not r.timed_out]
        timeouts = [i for i, r in enumerate(results) if r.timed_out]
        self._counts["reward/num_errors"] += len(errors)
        self._counts["reward/num_timeouts"] += len(timeouts)
        if errors:
            i = errors[0]
            logger.warning(
                "reward function %s failed on sample %d of %d (%d failed in this batch, scored 0): %s | "
                "data_source=%r ground_truth=%r solution_str=%r",
                self._fn_desc, i, len(items), len(errors), results[i].error,
                items[i]["data_source"], _shorten(items[i]["ground_truth"], 40, 80), _shorten(items[i]["solution_str"]),
            )
            if raw[i][4]:
                logger.debug("traceback of the first reward error:\n%s", raw[i][4])
        if timeouts:
            i = timeouts[0]
            logger.warning(
                "reward function %s took longer than %g s on sample %d (%d timed out in this batch, scored 0); "
                "its worker was killed and replaced | data_source=%r ground_truth=%r solution_str=%r",
                self._fn_desc, self.timeout_s, i, len(timeouts),
                items[i]["data_source"], _shorten(items[i]["ground_truth"], 40, 80), _shorten(items[i]["solution_str"]),
            )
        dropped = {key for r in raw if len(r) == 5 for key in r[3]} - self._warned_dropped
        if dropped:
            self._warned_dropped |= dropped
            logger.warning(
                "reward function %s returned non-numeric extra values for keys %s; they are dropped "
                "(extra metrics must be numbers)", self._fn_desc, sorted(dropped),
            )


def _picklable(item: dict) -> bool:
    try:
        pickle.dumps(item)
        return True
    except Exception:
        return False


def _check_items(items: list[dict]) -> None:
    """Fail fast, naming the item and key, when the caller built an item wrongly."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TypeError(f"RewardManager.score: item {i} is a {type(item).__name__}, expected a dict")
        missing = [key for key in REQUIRED_KEYS if key not in item]
        if missing:
            raise KeyError(f"RewardManager.score: item {i} lacks {missing}; items need {list(REQUIRED_KEYS)}")
