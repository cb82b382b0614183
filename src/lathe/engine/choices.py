"""The engine's choices by measurement, remembered per machine.

`pick_fastest` (`paged_attention.py`) chooses the decode attention kernel and a MoE model's decode experts by timing
each candidate. Where two candidates are close the timing is noise, and two processes that chose apart compute apart
(bf16 sums in another order: other samples from the same weights), so a run's ranks, a resumed run and the next run
of the same config could each draw other samples. So the first process to measure a probe on a kind of device, with
these versions of torch, Triton and the engine's source, keeps its choice in `$LATHE_CACHE_DIR/engine_choices.json` (`cache_root`),
under a file lock: the ranks of a node measure one after another, and the later ones take the first one's choice
once they have checked that it still runs here. Delete the file to measure afresh. Where the cache directory cannot
be written, each process measures for itself, as before, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lathe import device as accel
from lathe.models.paths import cache_root

log = logging.getLogger(__name__)
FILE = "engine_choices.json"
LOCK_TIMEOUT_S = 300.0
_warned: set[str] = set()


def path() -> Path:
    return cache_root() / FILE


def key(probe: str, device: torch.device | str) -> str | None:
    """What a remembered choice is valid for: the probe (its kernel, shapes and dtypes), the kind of device (its name,
    not its index) and the versions of the code that ran it (torch, Triton, the engine's source). None off an
    accelerator: nothing there is chosen by timing but in tests, which fake the timings."""
    device = torch.device(device)
    if not accel.is_accelerator(device):
        return None
    name = accel.properties(device.index or 0, device.type)["name"]
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return f"{probe} | {name} | torch {torch.__version__} | triton {triton_version} | engine {_engine_digest()}"


@functools.cache
def _engine_digest() -> str:
    """A digest of the engine's source (its kernels and how they are timed): an edited kernel is measured again."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def held(timeout_s: float | None = None) -> Iterator[bool]:
    """The file's lock, held for a measurement and its record (True), or nothing (False: measure without
    remembering) where the cache directory cannot be written, its file system takes no locks, or another process
    has held the lock for `timeout_s` (`LOCK_TIMEOUT_S`; a measurement takes seconds)."""
    lock = _locked(LOCK_TIMEOUT_S if timeout_s is None else timeout_s)
    if lock is None:
        yield False
        return
    try:
        yield True
    finally:
        lock.close()                                    # (closing the file releases its lock)


def _locked(timeout_s: float):
    """The lock file, opened and locked, or None (a warning, once, says why)."""
    try:
        import fcntl
        path().parent.mkdir(parents=True, exist_ok=True)
        lock = open(path().with_suffix(".lock"), "a")
    except (ImportError, OSError) as e:
        _warn_once(f"the engine's measured choices are not remembered ({e}): each process measures its own")
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() <= deadline:
                time.sleep(0.05)
                continue
            reason = f"another process has held {lock.name} for over {timeout_s:g} s"
        except OSError as e:                            # (a file system without locks: some NFS, Lustre, FUSE)
            reason = f"{lock.name} cannot be locked here: {e}"
        lock.close()
        _warn_once(f"the engine's measured choices are not remembered ({reason}): this process measures its own")
        return None


def recall(name: str) -> str | None:
    """The choice remembered under `name` (a `key`), or None."""
    try:
        return json.loads(path().read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None


def keep(name: str, choice: str) -> None:
    """Remember `choice` under `name` (the file rewritten whole, atomically; callers hold `held`)."""
    try:
        try:
            known = json.loads(path().read_text())
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known[name] = choice
        fd, tmp = tempfile.mkstemp(dir=path().parent, prefix=".engine_choices.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(known, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)                        # (mkstemp's 0600 would hide it from others sharing the cache)
            os.replace(tmp, path())
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        _warn_once(f"the engine's measured choice could not be remembered in {path()} ({e})")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
