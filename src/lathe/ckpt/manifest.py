"""A checkpoint's manifest: every file's size and content hash, written at save, verified before anything reads it.

`global_step_<k>/manifest.json`:

    {"format": "lathe-checkpoint-manifest", "version": 1,
     "hash": "sha256-blocks", "block_bytes": 67108864,
     "files": {"actor/huggingface/model.safetensors": {"size": 1234, "hash": "9f86d0..."}, ...}}

Paths are relative to the step directory (`/`-separated, sorted) and cover every regular file under it but the
manifest itself: weights, optimizer state (`optim.pt`, or every rank's `sharded/` files), a LoRA run's
`lora_adapter/`, the tokenizer, `trainer_state.pt`. A file's hash is the sha256 of the concatenated sha256
digests of its consecutive `block_bytes` blocks (one block for a small file; an empty file is one empty block),
so that the blocks of one large file (a 50 GB `optim.pt`) hash on several cores at once. sha256 runs on the
CPU's SHA instructions where there are any (most x86 and ARM server CPUs), faster than blake2b there.

A saver may hash files while it writes them (`prehash`: a file written by `HashingWriter`, or files hashed on a
background thread while the next file is written); it records the digests in a `.prehashed.json` beside them, and
`write_manifest` takes a digest from there when the file's size and modification time are still those recorded
(else it hashes the file again), then deletes the record. The digests are the same either way.

`verify` raises `CheckpointDamaged` naming the first file that is missing, of another size, or of other content;
`last_verified` finds the newest earlier checkpoint of the same run directory that verifies; `check` does both
and words the error with the fix its caller (resume, `lathe export`, `lathe model check`) gives. A checkpoint
without a manifest (written before lathe wrote them) cannot be verified: it loads, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("lathe")

MANIFEST = "manifest.json"
PREHASHED = ".prehashed.json"
FORMAT = "lathe-checkpoint-manifest"
VERSION = 1
HASH = "sha256-blocks"
BLOCK_BYTES = 64 << 20          # a unit of work for one thread
CHUNK_BYTES = 16 << 20          # one read
INLINE_BYTES = 1 << 20          # HashingWriter: a write smaller than this is hashed on the writing thread


class CheckpointDamaged(ValueError):
    """A checkpoint whose files do not match its manifest (`file` is relative to `checkpoint`); `problem` is what
    is wrong, without the fix."""

    def __init__(self, message: str, *, checkpoint: Path, file: str | None = None, last_good: Path | None = None,
                 problem: str | None = None):
        super().__init__(message)
        self.checkpoint, self.file, self.last_good = checkpoint, file, last_good
        self.problem = problem or message


def default_threads() -> int:
    """Every core, up to 32: a save waits for the hash (on an H200 host, 8 threads hashed 6 GB/s, 9-14% of a 1.5B
    save: bench/results/ckpt_save_1.5b_nvidia-h200.json)."""
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _block_digest(path: Path, start: int, length: int) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(CHUNK_BYTES, max(length, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left > 0:
            n = f.readinto(view[:min(left, len(buf))])
            if not n:
                raise OSError(f"{path} ended {left} bytes early while it was being hashed")
            h.update(view[:n])
            left -= n
    return h.digest()


def hash_files(paths: list[Path], *, threads: int | None = None) -> list[tuple[int, str]]:
    """(size, hash) of each file, its blocks hashed on `threads` threads (hashlib releases the GIL)."""
    sizes = [p.stat().st_size for p in paths]
    jobs = [(i, start, min(BLOCK_BYTES, size - start))
            for i, size in enumerate(sizes) for start in range(0, max(size, 1), BLOCK_BYTES)]
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        digests = list(pool.map(lambda job: _block_digest(paths[job[0]], job[1], job[2]), jobs))
    per_file: list[list[bytes]] = [[] for _ in paths]
    for (i, _, _), digest in zip(jobs, digests):
        per_file[i].append(digest)
    return [(size, _digest(blocks)) for size, blocks in zip(sizes, per_file)]


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.relative_to(root).as_posix() != MANIFEST
                  and p.name != PREHASHED)


def _digest(blocks: list[bytes]) -> str:
    return hashlib.sha256(b"".join(blocks)).hexdigest()


class HashingWriter:
    """A binary file for `torch.save` that hashes its blocks while they are written (the same digest as
    `hash_files`): each write's whole blocks are hashed on `pool` while this thread writes the bytes, so the
    hash costs no time of its own; `close()` returns (size, hash)."""

    def __init__(self, path: Path, pool: ThreadPoolExecutor):
        self.path, self.pool = Path(path), pool
        self.file = open(self.path, "wb")
        self.size, self.blocks, self.current, self.filled = 0, [], hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < INLINE_BYTES:                               # small writes (zip headers, scalars): inline
            self._feed(view)
            self.file.write(view)
            self.size += n
            return n
        jobs, offset = [], 0
        if self.filled:                                    # finish the open block first
            head = view[:BLOCK_BYTES - self.filled]
            jobs.append(self.pool.submit(self.current.update, head))
            offset = len(head)
            self.filled += len(head)
            if self.filled == BLOCK_BYTES:
                self.blocks.append(self.current)
                self.current, self.filled = hashlib.sha256(), 0
        while n - offset >= BLOCK_BYTES:
            block = hashlib.sha256()
            jobs.append(self.pool.submit(block.update, view[offset:offset + BLOCK_BYTES]))
            self.blocks.append(block)
            offset += BLOCK_BYTES
        if offset < n:
            jobs.append(self.pool.submit(self.current.update, view[offset:]))
            self.filled += n - offset
        self.file.write(view)                              # while the pool hashes the same bytes
        for job in jobs:
            job.result()
        self.size += n
        return n

    def _feed(self, view: memoryview) -> None:
        while len(view):
            take = view[:BLOCK_BYTES - self.filled]
            self.current.update(take)
            self.filled += len(take)
            view = view[len(take):]
            if self.filled == BLOCK_BYTES:
                self.blocks.append(self.current)
                self.current, self.filled = hashlib.sha256(), 0

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> tuple[int, str]:
        self.file.close()
        blocks = self.blocks + ([self.current] if self.filled or not self.blocks else [])
        return self.size, _digest([b.digest() for b in blocks])


def prehash(root: Path, digests: dict[Path, tuple[int, str]]) -> None:
    """Record the digests of files under `root` (taken while they were written) in `root/.prehashed.json`."""
    root = Path(root)
    record = {}
    for path, (size, digest) in digests.items():
        stat = Path(path).stat()
        if stat.st_size == size:
            record[Path(path).relative_to(root).as_posix()] = {"size": size, "mtime_ns": stat.st_mtime_ns,
                                                              "hash": digest}
    path = root / PREHASHED
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **record}))


def save_hashed(obj, path: Path, *, written: list[Path] = ()) -> None:
    """`torch.save(obj, path)` with its digest taken as it is written, while the files `written` just before it
    (a checkpoint's weights) are hashed on other threads; all recorded for `write_manifest` (`prehash`), so a
    save does not read its files back to hash them."""
    import torch
    path = Path(path)
    with ThreadPoolExecutor(1) as side, ThreadPoolExecutor(default_threads()) as pool:
        earlier = side.submit(hash_files, list(written)) if written else None
        writer = HashingWriter(path, pool)
        try:
            torch.save(obj, writer)
        finally:
            size, digest = writer.close()
        digests = {path: (size, digest)}
        if earlier is not None:
            digests.update(zip(written, earlier.result()))
    prehash(path.parent, {p: d for p, d in digests.items() if Path(p).is_relative_to(path.parent)})


def _prehashed(root: Path) -> dict[str, tuple[int, str]]:
    """The digests recorded under `root` that still describe their files (size and mtime unchanged); the records
    are removed."""
    out: dict[str, tuple[int, str]] = {}
    for record in root.rglob(PREHASHED):
        base = record.parent
        try:
            entries = json.loads(record.read_text())
        except (OSError, ValueError):
            entries = {}
        record.unlink()
        for name, entry in entries.items():
            path = base / name
            try:
                stat = path.stat()
            except OSError:
                continue
            if stat.st_size == entry["size"] and stat.st_mtime_ns == entry["mtime_ns"]:
                out[path.relative_to(root).as_posix()] = (entry["size"], entry["hash"])
    return out


def write_manifest(root: str | Path, *, threads: int | None = None) -> dict:
    """Hash every file under the step directory `root` into `root/manifest.json` (call it once every part is on
    disk, before the directory is renamed into place); return the manifest."""
    root = Path(root)
    known = _prehashed(root)
    names = _files(root)
    todo = [n for n in names if n not in known]
    known.update(zip(todo, hash_files([root / n for n in todo], threads=threads)))
    manifest = {"format": FORMAT, "version": VERSION, "hash": HASH, "block_bytes": BLOCK_BYTES,
                "files": {n: {"size": known[n][0], "hash": known[n][1]} for n in names}}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(root / MANIFEST)
    return manifest


def read_manifest(root: Path) -> dict | None:
    """The manifest of checkpoint `root`, or None when it has none; raises `CheckpointDamaged` when unreadable."""
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        ok = (manifest.get("format") == FORMAT and manifest.get("hash") == HASH
              and manifest.get("block_bytes") == BLOCK_BYTES and isinstance(manifest.get("files"), dict))
    except (ValueError, UnicodeDecodeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointDamaged(f"checkpoint {root}: its {MANIFEST} is damaged or of a format this lathe does not "
                                "read, so its files cannot be verified.", checkpoint=root, file=MANIFEST)
    return manifest


def verify(root: str | Path, *, threads: int | None = None) -> bool:
    """True when every file of checkpoint `root` matches its manifest; False when it has no manifest; raises
    `CheckpointDamaged` naming the first file that is missing, truncated or grown, or of other content."""
    root = Path(root)
    manifest = read_manifest(root)
    if manifest is None:
        return False
    entries = manifest["files"]
    present = []
    for name, entry in entries.items():
        path = root / name
        if not path.is_file():
            raise CheckpointDamaged(f"checkpoint {root} is damaged: {name} is missing (its manifest lists it, "
                                    f"{entry['size']} bytes).", checkpoint=root, file=name)
        size = path.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            raise CheckpointDamaged(f"checkpoint {root} is damaged: {name} is {what} ({size} bytes; the manifest "
                                    f"says {entry['size']}).", checkpoint=root, file=name)
        present.append(name)
    for name, (_, digest) in zip(present, hash_files([root / n for n in present], threads=threads)):
        if digest != entries[name]["hash"]:
            raise CheckpointDamaged(f"checkpoint {root} is damaged: {name} does not hold what was written (its "
                                    "content hash differs from the manifest's: flipped bytes on disk or a file "
                                    "changed after the save).", checkpoint=root, file=name)
    return True


def last_verified(root: str | Path, *, threads: int | None = None) -> Path | None:
    """The newest checkpoint of `root`'s run directory that is older than `root` and verifies (has a manifest and
    matches it), or None."""
    root = Path(root)
    step = _step_of(root)
    earlier = sorted((d for d in root.parent.glob("global_step_*")
                      if d.is_dir() and d != root and _step_of(d) is not None
                      and (step is None or _step_of(d) < step)), key=_step_of, reverse=True)
    for candidate in earlier:
        try:
            if verify(candidate, threads=threads):
                return candidate
        except CheckpointDamaged:
            continue
    return None


def check(root: str | Path, *, fix: Callable[[Path | None], str], prefix: str = "",
          warn: Callable[[str], None] = log.warning, threads: int | None = None) -> bool:
    """`verify` checkpoint `root`: True when it verifies; False, with one `warn`ing, when it has no manifest.
    A damaged one raises `CheckpointDamaged`, one paragraph naming the file, the checkpoint, the last one of the
    run that verifies (`last_good`, also an attribute) and `fix(last_good)`."""
    root = Path(root)
    try:
        ok = verify(root, threads=threads)
    except CheckpointDamaged as e:
        good = last_verified(root, threads=threads)
        where = (f"The last checkpoint under {root.parent} that verifies is {good.name}." if good is not None else
                 f"No earlier checkpoint under {root.parent} verifies.")
        raise CheckpointDamaged(f"{prefix}{e} {where} Fix: {fix(good)}", checkpoint=root, file=e.file,
                                last_good=good, problem=str(e)) from None
    if not ok:
        warn(f"checkpoint {root} has no {MANIFEST} (it was written before lathe wrote manifests): its files cannot "
             "be verified, and it loads as it is.")
    return ok


def _step_of(path: Path) -> int | None:
    tail = path.name.split("_")[-1]
    return int(tail) if path.name.startswith("global_step_") and tail.isdigit() else None


def manifest_cost(path: str | Path, *, threads: int | None = None) -> dict:
    """How long hashing `path` (a file, or every file under a directory) takes: files, bytes, seconds, MB/s.

        python -c "from lathe.ckpt.manifest import manifest_cost; print(manifest_cost('ckpts/run/global_step_20'))"
    """
    path = Path(path)
    files = [path] if path.is_file() else [path / n for n in _files(path)]
    start = time.perf_counter()
    hashed = hash_files(files, threads=threads)
    seconds = time.perf_counter() - start
    total = sum(size for size, _ in hashed)
    return {"files": len(files), "bytes": total, "seconds": round(seconds, 3), "threads": threads or default_threads(),
            "mb_per_s": round(total / 1e6 / max(seconds, 1e-9), 1)}
