"""Forked worker processes that run a reward function and can be killed when it hangs.

Why fork: the child inherits the already-loaded reward function (a closure, a lambda, a
function loaded from a file), so only items and result tuples cross the pipe and nothing
about the function must be picklable. Each worker leads its own process group, so killing
it also kills whatever the scorer started (a sandboxed program, a shell). A worker whose
parent disappears (killed with SIGKILL, so no atexit ran) kills itself within a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import warnings
import weakref
from collections import deque
from time import monotonic
from typing import Callable

from lathe.reward.scoring import score_one

__all__ = ["Worker"]

# Parent ends of every live worker's pipe; a new child closes its copies of them, so a
# worker sees EOF as soon as its own parent end is closed.
_OPEN: weakref.WeakSet = weakref.WeakSet()
_ORPHAN_CHECK_S = 1.0


class Worker:
    """One forked process scoring the chunks it is sent, one result message per sample.

    ``run(fn, item, index, fn_desc)`` makes each result (:func:`score_one`: one sample; the batch manager sends its
    whole batch as one item and calls the function once). The parent tracks ``pending`` (sent, unanswered
    indices, in order) and ``started`` (when the sample at the head of ``pending`` began, as seen from here),
    which is what tells a hung sample apart.
    """

    def __init__(self, fn: Callable, fn_desc: str, run: Callable = score_one):
        ctx = multiprocessing.get_context("fork")
        self._owner_pid = os.getpid()
        self.conn, child_conn = ctx.Pipe(duplex=True)
        _OPEN.add(self)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, fn, fn_desc, os.getpid(), run), name="lathe-reward-worker"
        )
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process; the child only runs
            # the scorer and talks over its own pipe, which is the case fork handles well.
            warnings.simplefilter("ignore", DeprecationWarning)
            self.process.start()
        child_conn.close()
        self.pid: int = self.process.pid
        try:
            os.setpgid(self.pid, self.pid)  # also done by the child; whoever runs first wins
        except OSError:
            pass
        self.pending: deque[int] = deque()
        self.started = monotonic()

    def send(self, indices: list[int], items: list[dict]) -> None:
        """Send one chunk; the samples become pending."""
        self.conn.send([(i, items[i]) for i in indices])
        self.pending.extend(indices)
        self.started = monotonic()

    def drain(self, raw: list) -> None:
        """Store every result already waiting in the pipe; EOFError if the worker died."""
        while self.pending and self.conn.poll():
            index, result = self.conn.recv()
            expected = self.pending.popleft()
            if index != expected:
                raise RuntimeError(f"reward worker {self.pid} answered sample {index}, expected {expected}")
            raw[index] = result
            self.started = monotonic()

    def exitcode(self) -> int | None:
        """Exit code of a dead worker (negative: killed by that signal)."""
        self.process.join(timeout=1.0)
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the worker's process group, reap it, close the pipe. Idempotent."""
        if self.process is None or os.getpid() != self._owner_pid:
            return  # a forked copy of this object must never kill its siblings
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.process.kill()
        except (OSError, ValueError):
            pass
        self.process.join(timeout=5.0)
        self.conn.close()
        _OPEN.discard(self)
        self.process = None
        self.pending.clear()


def _exit_when_orphaned(parent_pid: int) -> None:
    """Child thread: if the parent is gone, kill this worker's whole process group."""
    while True:
        time.sleep(_ORPHAN_CHECK_S)
        if os.getppid() != parent_pid:
            try:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            finally:
                os._exit(1)


def _worker_main(conn, fn: Callable, fn_desc: str, parent_pid: int, run: Callable) -> None:
    """Child: score chunks until the pipe closes or ``None`` arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    for worker in list(_OPEN):
        worker.conn.close()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, item in chunk:
            conn.send((index, run(fn, item, index, fn_desc)))
