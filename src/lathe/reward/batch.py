"""BatchRewardManager: verl's ``batch`` reward manager, one call of the user's function per scoring call.

The function gets the whole batch as lists, by keyword, plus its reward kwargs (carried by
:class:`lathe.reward.custom.RewardFn`)::

    fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...]) -> [result per row]

and returns one result per row, in order: a float, or a dict whose ``score`` is the score and whose other
numeric entries are extra metrics, judged exactly as :class:`~lathe.reward.manager.RewardManager` judges a
per-row result. One row's unusable value (None, NaN, a dict without ``score``) costs only that row: scored 0,
counted in ``reward/num_errors``, and the same wholesale-failure rule stops a run that keeps doing it.

The call itself is all or nothing: when it raises, returns something that is not one result per row (verl
would index past a short list, or drop a long one's tail), crashes its process or does not answer in time, no
row has a score, so :class:`BatchRewardError` stops the run, naming the function, the batch size and what came
back, rather than train on made-up scores.

With ``timeout_s > 0`` the call runs in a forked worker (:mod:`lathe.reward.workers`, which inherits the
loaded function: nothing of it is pickled) and may take ``timeout_s`` per row, ``timeout_s * len(batch)`` in
all; a call that has not answered by then is killed with its process group. ``timeout_s <= 0`` calls the
function in this process, with no bound.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

from lathe.reward.manager import RewardManager, _picklable
from lathe.reward.scoring import coerce_result
from lathe.reward.workers import Worker

__all__ = ["BatchRewardError", "BatchRewardManager", "call_batch"]

MANAGER = "reward_model.reward_manager=batch"
_SHAPE = "it must return one float, or dict with a 'score' key, per response, in the order of solution_strs"


class BatchRewardError(RuntimeError):
    """The batch call raised, returned the wrong number of results, crashed its worker or timed out."""


def _shorten(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]} ..."


def _shape_problem(value: Any, n: int) -> str | None:
    """What is wrong with `value` as the results of `n` rows (None: one per row)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        what = f"a dict with keys {sorted(map(str, value))[:10]}" if isinstance(value, dict) else (
            f"a {type(value).__name__} ({_shorten(value, 60)})")
        return f"{what} instead of a list of results"
    try:
        size = len(value)
    except TypeError:        # a generator, a 0-d array
        return f"a {type(value).__name__} without a length ({_shorten(value, 60)}) instead of a list of results"
    if size != n:
        return f"{size} results ({_shorten(value)})"
    return None


def call_batch(fn: Callable, items: list[dict], _index: int, fn_desc: str) -> tuple:
    """Call `fn` once on `items`; never raises. ``("ok", [per-row (score, extra, error, dropped, None)])`` or
    ``("error", message, traceback)``. Runs in the worker process (or in this one without a timeout)."""
    n = len(items)
    try:
        value = fn(data_sources=[item["data_source"] for item in items],
                   solution_strs=[item["solution_str"] for item in items],
                   ground_truths=[item["ground_truth"] for item in items],
                   extra_infos=[item.get("extra_info") for item in items])
    except Exception as exc:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return "error", f"reward function {fn_desc} ({MANAGER}) raised {last} on a batch of {n} responses", \
            traceback.format_exc()
    problem = _shape_problem(value, n)
    if problem is not None:
        return "error", f"reward function {fn_desc} ({MANAGER}) returned {problem} for a batch of {n} responses; " \
            f"{_SHAPE}", ""
    return "ok", [(*coerce_result(v, i, fn_desc), None) for i, v in enumerate(value)]


class BatchRewardManager(RewardManager):
    """Scores a batch of ``{"data_source", "solution_str", "ground_truth", "extra_info"}`` with one call of
    ``compute_score`` (see the module docstring); the same results, metrics and life cycle as RewardManager."""

    one_call = True   # (lathe.loop.reward_async: one call bounds the whole batch)

    def __init__(self, compute_score: Callable, *, timeout_s: float = 10.0, max_failure_fraction: float = 0.5,
                 max_failing_calls: int = 3):
        """`timeout_s`: each row's share of the call's bound (`<= 0`: in this process, no bound)."""
        super().__init__(compute_score, timeout_s=timeout_s, num_workers=1,
                         max_failure_fraction=max_failure_fraction, max_failing_calls=max_failing_calls)

    def _score_raw(self, items: list[dict]) -> list[tuple]:
        """Each row's raw result from one call of the function; BatchRewardError when the call fails."""
        if self.timeout_s <= 0:
            out = call_batch(self.compute_score, items, 0, self._fn_desc)
        else:
            out = self._call_in_worker(items)
        if out[0] != "ok":
            fix = ("Fix the function: every row's score comes from this one call, so the run stops rather than "
                   "train on scores it does not have.")
            raise BatchRewardError(f"{out[1]}\n{out[2].rstrip()}\n{fix}" if out[2] else f"{out[1]}. {fix}")
        return out[1]

    def _new_worker(self) -> Worker:
        return Worker(self.compute_score, self._fn_desc, run=call_batch)

    def _call_in_worker(self, items: list[dict]) -> tuple:
        """`call_batch` in the worker, waiting at most timeout_s per row; the worker is killed on any failure (a
        fresh one is forked by the next call)."""
        n, bound = len(items), self.timeout_s * len(items)
        try:
            if not self._workers:
                self._workers.append(self._new_worker())
            worker = self._workers[0]
            try:
                worker.send([0], [items])
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                self._replace(0)            # it died between calls: once more with a fresh one
                worker = self._workers[0]
                worker.send([0], [items])
            except Exception as exc:        # pickling failed before anything was written
                bad = [i for i, item in enumerate(items) if not _picklable(item)]
                raise BatchRewardError(
                    f"reward function {self._fn_desc} ({MANAGER}): the batch of {n} responses could not be sent to "
                    f"its worker process ({type(exc).__name__}: {exc}); rows {bad[:10]} hold values that cannot be "
                    "pickled. Fix: make their data_source, ground_truth and extra_info picklable, or set "
                    "reward.timeout_s=0 to call the function in this process") from None
            if not worker.conn.poll(bound):
                raise BatchRewardError(
                    f"reward function {self._fn_desc} ({MANAGER}) did not answer within {bound:g} s for a batch of "
                    f"{n} responses (reward.timeout_s={self.timeout_s:g} per response, one call for the batch); its "
                    "worker process was killed. Fix: make the function faster, or raise reward.timeout_s (0 calls "
                    "it in this process with no bound)")
            raw: list = [None]
            try:
                worker.drain(raw)
            except (EOFError, OSError):
                raise BatchRewardError(
                    f"reward function {self._fn_desc} ({MANAGER}): its worker process died (exit code "
                    f"{worker.exitcode()}) while scoring a batch of {n} responses, so no row has a score. Fix the "
                    "function (a crash in native code, os._exit, running out of memory)") from None
            return raw[0]
        except BaseException:
            self.close()        # a half-done call: start clean next time
            raise
