"""A cache of warm-started models, keyed by everything the warm start computes from.

The built-in demo's supervised warm start takes a minute on a laptop and gives the same weights every time, so
its result is kept under ``$LATHE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/lathe``, else ``~/.cache/lathe``) in
``warm_start/<key>/`` and a later run with the same inputs copies it instead of training again. The key is a
sha256 over: the examples' token ids (data, tokenizer and chat template in one), the starting model (a built-in
name with its seed and vocabulary, or a local directory's file names, sizes and modification times, or a hub
id), the warm start's steps, learning rate and batch size, the seed, the device type, torch's version and the
source of the code that computes it (``lathe/models``, ``lathe/train/sft.py``). Each entry carries a checkpoint
manifest and is verified before use; a damaged entry is dropped and trained again.
``actor_rollout_ref.model.warm_start.cache=false`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lathe.ckpt.manifest import CheckpointDamaged, verify, write_manifest
from lathe.models.paths import cache_root

log = logging.getLogger("lathe")
INPUTS = "inputs.json"      # what the key was computed from, for a person reading the cache


def _code_digest() -> str:
    import lathe
    root = Path(lathe.__file__).parent
    files = sorted((root / "models").rglob("*.py")) + [root / "train" / "sft.py"]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _model_identity(path: str, load_kwargs: dict) -> dict:
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        files = sorted((p.relative_to(local).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                       for p in local.rglob("*") if p.is_file())
        ident = {"dir": str(local.resolve()), "files": files}
    else:
        ident = {"name": path, **{k: load_kwargs.get(k) for k in ("vocab_size", "seed", "override_config", "impl")}}
    if load_kwargs.get("dist_checkpoint") is not None:      # the weights come from a Megatron checkpoint instead
        ident["dist_checkpoint"] = _model_identity(load_kwargs["dist_checkpoint"], {})
        ident["dist_checkpoint_prefix"] = load_kwargs.get("dist_checkpoint_prefix", "")
    return ident


def warm_start_key(*, path: str, load_kwargs: dict, examples: list[tuple[list[int], list[int]]], steps: int,
                   lr: float, batch_size: int, seed: int, device_type: str) -> tuple[str, dict]:
    """(hex key, the inputs it was computed from, examples summarised by their hash)."""
    inputs = {"model": _model_identity(path, load_kwargs),
              "examples": hashlib.sha256(json.dumps(examples).encode()).hexdigest(), "n_examples": len(examples),
              "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "device": device_type,
              "torch": torch.__version__, "code": _code_digest()}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32], inputs


def fetch(key: str, into: Path) -> bool:
    """Copy the cached warm start `key` into `into` (the run's init_model); False when there is none (or it was
    damaged, and has been dropped)."""
    entry = cache_root() / "warm_start" / key
    if not (entry / "config.json").exists():
        return False
    try:
        if not verify(entry):
            raise CheckpointDamaged(f"{entry} has no manifest", checkpoint=entry, file="manifest.json")
    except CheckpointDamaged as e:
        log.warning("warm start cache: %s; dropping it and training again", e)
        shutil.rmtree(entry, ignore_errors=True)
        return False
    shutil.copytree(entry, into, dirs_exist_ok=True, ignore=shutil.ignore_patterns(INPUTS, "manifest.json"))
    return True


def store(key: str, inputs: dict, model_dir: Path) -> None:
    """Keep `model_dir` (a saved warm start) as cache entry `key`; a cache that cannot be written costs a warning."""
    root = cache_root() / "warm_start"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
        (tmp / INPUTS).write_text(json.dumps(inputs, indent=1))
        write_manifest(tmp)
        try:
            tmp.rename(root / key)
        except OSError:             # another run stored the same key first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.warning("warm start cache: could not write %s (%s); the next run will warm-start again. "
                    "Set LATHE_CACHE_DIR to a writable directory, or warm_start.cache=false.", root, e)
