"""Progress a person can see: a live line on a terminal, plain timestamped lines in a log.

    with Progress("warm start", total=80) as bar:             # counted work: i/N, pace, ETA
        for i in range(80):
            ...
            bar.update(i + 1, f"loss {loss:.3f}")
    with phase("loading the policy from /models/qwen"):       # one long call: its elapsed time
        model = load(...)

On a terminal (the stream, stderr by default, is a tty) the work is one line at the bottom, redrawn in place
with ``\\r`` (``warm start 34/80 42% | 5.1 step/s | eta 9s | loss 1.23``) every second and at each update, and
erased when the work ends; `echo` and the logging handler `LiveLineHandler` print their lines above it.
Anywhere else (a file, a pipe, CI) nothing is redrawn and no control character is written: counted work logs
that line every ``every_s`` seconds; a phase logs ``<what> ... 2.0s`` once it has run ``announce_s`` seconds
and ``<done> in 12s`` when it ends (when it took ``report_s`` or more). Those lines go to the ``lathe`` logger,
which the CLI stamps ``HH:MM:SS`` (`LOG_FORMAT`). No third-party bar library: this is all of it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Progress", "phase", "echo", "stamp", "duration", "eta_seconds", "pace", "is_terminal",
           "LiveLineHandler", "Once", "LOG_FORMAT", "TIME_FORMAT"]

log = logging.getLogger("lathe")

TIME_FORMAT = "%H:%M:%S"                       # the stamp on every line lathe prints
LOG_FORMAT = "%(asctime)s lathe: %(message)s"  # the CLI's log lines (with datefmt=TIME_FORMAT)


def stamp(when: float | None = None) -> str:
    """``HH:MM:SS`` local time (now, or the epoch seconds ``when``)."""
    return time.strftime(TIME_FORMAT, time.localtime(when))


def duration(seconds: float) -> str:
    """``0.42s``, ``8.1s``, ``42s``, ``3m05s``, ``2h07m``."""
    if seconds < 1:
        return f"{max(seconds, 0):.2f}s"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def eta_seconds(done: int, total: int | None, elapsed: float) -> float | None:
    """Seconds left for the ``total - done`` units still to do at the mean pace so far (``elapsed`` seconds for
    ``done`` units); None before the first unit or without a total."""
    if not total or done <= 0:
        return None
    return elapsed / done * max(0, total - done)


def pace(done: int, elapsed: float, unit: str) -> str:
    """``5.1 step/s`` for quick units, ``1.4s/step`` for slow ones; '' before the first."""
    if done <= 0 or elapsed <= 0:
        return ""
    per = elapsed / done
    return f"{1 / per:.1f} {unit}/s" if per < 1 else f"{duration(per)}/{unit}"


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):         # no isatty, or a closed stream
        return False


class _LiveLine:
    """The one line at the bottom of the terminal that progress redraws; whatever is printed goes above it.

    Active progress objects stack (validation inside a training step shows its own line, then the step's line
    comes back). Erasing writes spaces, not an ANSI code, so even a dumb terminal shows it right."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No line and a fresh lock: a forked child (a reward worker) must not wait on a lock its parent's progress
        thread held at the fork."""
        self.lock = threading.RLock()
        self.owners: list[Progress] = []
        self.drawn = 0                            # characters of the line on screen now
        self.partial = False                      # another writer left its line unfinished: do not draw over it

    def draw(self) -> None:
        with self.lock:
            if not self.owners or self.partial:
                return
            top = self.owners[-1]
            width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
            text = top.text()[:width].ljust(self.drawn)
            top.stream.write("\r" + text)
            top.stream.flush()
            self.drawn = len(text)

    def erase(self) -> None:
        with self.lock:
            if self.drawn and self.owners:
                stream = self.owners[-1].stream
                stream.write("\r" + " " * self.drawn + "\r")
                stream.flush()
            self.drawn = 0

    @contextmanager
    def above(self) -> Iterator[None]:
        """Erase the line, let the caller print, draw it again below."""
        with self.lock:
            self.erase()
            try:
                yield
            finally:
                self.draw()

    def push(self, owner: Progress) -> None:
        with self.above():
            self.owners.append(owner)
            _guard_streams()

    def pop(self, owner: Progress) -> None:
        with self.above():
            if owner in self.owners:
                self.owners.remove(owner)
            if not self.owners:
                _unguard_streams()


class _Guarded:
    """``sys.stdout`` / ``sys.stderr`` while a live line is on a terminal: whatever else prints (Ray's worker-log
    thread, a Python warning, a ``print``) first erases the line, and a write that ends its line draws it again
    below, so the two never share a row. Everything but ``write`` is the stream's own."""

    def __init__(self, raw: TextIO):
        self.raw = raw

    def write(self, text: str) -> int:
        with LIVE.lock:
            LIVE.erase()
            n = self.raw.write(text)
            self.raw.flush()
            if text:
                LIVE.partial = not text.endswith("\n")
            LIVE.draw()
            return n

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def _guard_streams() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _Guarded) and is_terminal(stream):
            setattr(sys, name, _Guarded(stream))


def _unguard_streams() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Guarded):
            setattr(sys, name, stream.raw)


LIVE = _LiveLine()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LIVE.reset)


def echo(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` to ``stream`` (stdout) above the live line."""
    stream = stream if stream is not None else sys.stdout
    with LIVE.above():
        stream.write(line + "\n")
        stream.flush()


class Progress:
    """Counted work (``total`` units, from ``initial``) or, without a total, one long call: see the module
    docstring. In a log, counted work writes its line at an `update` when ``every_s`` seconds have passed since
    the last (``0``: at every update; ``None``: never, as the training loop's step lines say it all), and a phase
    when ``announce_s``, then ``every_s``, seconds have passed. ``tick_s``: how often a background thread redraws
    the live line or checks whether a phase's line is due (None: no thread; tests pass a fake ``clock``)."""

    def __init__(self, desc: str, total: int | None = None, *, initial: int = 0, unit: str = "step",
                 every_s: float | None = 30.0, announce_s: float | None = None, stream: TextIO | None = None,
                 live: bool | None = None, tick_s: float | None = 1.0, clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.unit = desc, total, unit
        self.initial = self.n = initial
        self.info = ""
        self.every_s, self.announce_s = every_s, announce_s
        self.stream = stream if stream is not None else sys.stderr
        if isinstance(self.stream, _Guarded):                 # the live line writes to the terminal itself
            self.stream = self.stream.raw
        self.live = is_terminal(self.stream) if live is None else live
        self.clock = clock
        self.start = self.updated = self.logged = clock()
        self.lines = 0                              # lines logged (when not live)
        self._drawn_at = -1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.live:
            LIVE.push(self)
        if tick_s is not None and (self.live or total is None):       # (counted work logs at its updates)
            self._thread = threading.Thread(target=self._run, args=(tick_s,), name="lathe-progress", daemon=True)
            self._thread.start()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the pace so far, counted down since the last update."""
        now = self.clock() if now is None else now
        left = eta_seconds(self.n - self.initial, None if self.total is None else self.total - self.initial,
                           self.updated - self.start)
        return None if left is None else max(0.0, left - (now - self.updated))

    def text(self, now: float | None = None) -> str:
        """``desc n/total pct% | pace | eta | info``, or for a phase ``desc ... elapsed`` (from 1 s on)."""
        now = self.clock() if now is None else now
        if self.total is None and self.n == self.initial:
            took = now - self.start
            return " | ".join(p for p in (f"{self.desc} ..." + (f" {duration(took)}" if took >= 1 else ""), self.info)
                              if p)
        done = self.n - self.initial
        parts = [f"{self.desc} {self.n}/{self.total} {100 * self.n / self.total:.0f}%" if self.total
                 else f"{self.desc} {self.n}", pace(done, self.updated - self.start, self.unit)]
        eta = self.eta(now)
        if eta is not None and self.n < (self.total or 0):
            parts.append(f"eta {duration(eta)}")
        parts.append(self.info)
        return " | ".join(p for p in parts if p)

    def update(self, n: int, info: str | None = None) -> None:
        """``n`` units done (absolute, so a resumed count stays right); ``info`` replaces the line's tail."""
        self.n, self.updated = n, self.clock()
        if info is not None:
            self.info = info
        if not self.live:
            self.tick()
        elif self.updated - self._drawn_at >= 0.1 or n == self.total:     # a redraw at most every 0.1 s
            self._drawn_at = self.updated
            LIVE.draw()

    def tick(self) -> None:
        """Redraw the live line; or, in a log, write the line when one is due."""
        if self.live:
            LIVE.draw()
            return
        now = self.clock()
        wait = self.announce_s if self.lines == 0 and self.announce_s is not None else self.every_s
        if wait is not None and now - self.logged >= wait:
            self.logged, self.lines = now, self.lines + 1
            log.info("%s", self.text(now))

    def _run(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            self.tick()

    def close(self) -> None:
        """Stop the thread and erase the live line (safe to call twice)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.live:
            LIVE.pop(self)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def phase(desc: str, *, done: str | None = None, report_s: float | None = 1.0, announce_s: float = 2.0,
          every_s: float = 60.0, stream: TextIO | None = None) -> Iterator[Progress]:
    """One long call shown while it runs; ``<done> in <duration>`` logged at its end when it took ``report_s`` or
    more (``done`` defaults to ``<desc>: done``; ``report_s=None``: never). Nothing is logged when it raises."""
    p = Progress(desc, every_s=every_s, announce_s=announce_s, stream=stream)
    try:
        yield p
    finally:
        p.close()
    if report_s is not None and p.elapsed >= report_s:
        log.info("%s in %s", done or f"{desc}: done", duration(p.elapsed))


class LiveLineHandler(logging.StreamHandler):
    """A logging handler to stderr (the one of the moment, so a replaced ``sys.stderr`` is followed) that prints
    above the live line."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is not sys.stderr:
            self.setStream(sys.stderr)
        with LIVE.above():
            super().emit(record)


class Once(logging.Filter):
    """Lets a warning through the first time its text is seen: the same warning from each role, rank or step
    prints once (other levels pass untouched)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True
