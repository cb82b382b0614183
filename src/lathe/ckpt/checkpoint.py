"""Save and resume: model, optimizer, scheduler, dataloader position and every RNG state.

Layout (verl's): `<default_local_dir>/global_step_<k>/{actor/, critic/, trainer_state.pt}` plus
`latest_checkpointed_iteration.txt`. `actor/huggingface/` is a plain Hugging Face checkpoint directory:
transformers loads it as is.

A save never damages what was there: every part is written into `.global_step_<k>.partial/`, which is renamed
to `global_step_<k>` only when all parts are on disk; the "latest" marker moves after that, and old
checkpoints are pruned last (never the one just written). A save that fails midway (full disk, a kill)
leaves the previous checkpoint intact and "latest". Before the rename, `manifest.json` records every file's size
and content hash (`lathe.ckpt.manifest`); resume verifies them before reading anything. Everything is read back
with `torch.load(weights_only=True)` (tensors and plain values only: no pickled code runs on resume).
"""

from __future__ import annotations

import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lathe import device
from lathe.ckpt import manifest
from lathe.ckpt.resume import LATEST, resume_point, step_dir
from lathe.track.progress import phase

log = logging.getLogger("lathe")


def capture_rng() -> dict[str, Any]:
    """Every RNG state as tensors and plain values (loadable with `weights_only=True`)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state(), **device.rng_states()}      # + "cuda" (or "npu"): every device's
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["gauss"]))
    torch.set_rng_state(state["torch"])
    device.set_rng_states({k: v for k, v in state.items() if k in ("cuda", "npu")})


def save_checkpoint(root: str | Path, step: int, parts: dict[str, Any], trainer_state: dict[str, Any], *,
                    max_to_keep: int | None = None) -> Path:
    """Write step `step`'s checkpoint: each of `parts` (`{"actor": worker, "critic": critic}`, each with
    `save_checkpoint(dir)`) under its name plus `trainer_state.pt`, all in a partial directory renamed into
    place when complete; then mark it latest, then prune old ones beyond `max_to_keep`."""
    path = step_dir(Path(root), step)
    with phase(f"saving checkpoint {path}", done=f"saved checkpoint {path}", report_s=0.0):
        return _save(Path(root), path, step, parts, trainer_state, max_to_keep)


def _save(root: Path, path: Path, step: int, parts: dict[str, Any], trainer_state: dict[str, Any],
          max_to_keep: int | None) -> Path:
    partial = root / f".global_step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name, worker in parts.items():
        worker.save_checkpoint(partial / name)
    torch.save({**trainer_state, "global_step": step, "rng": capture_rng()}, partial / "trainer_state.pt")
    manifest.write_manifest(partial)    # every part is on disk: the parts' savers return when all ranks wrote
    replaced = None
    if path.exists():                 # the same step saved again (a run resumed before it): swap, then drop
        replaced = path.rename(root / f".global_step_{step}.replaced")
    partial.rename(path)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(str(step))
    tmp.replace(root / LATEST)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    if max_to_keep:   # only steps up to this one: later ones (from a run resumed earlier) may sort above it
        for old in sorted((d for d in _step_dirs(root) if _step_of(d) <= step), key=_step_of)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / "trainer_state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path / 'trainer_state.pt'} holds pickled objects that lathe does not read (only tensors "
                         "and plain values load, so that no code in a checkpoint runs); it was written by an older "
                         f"lathe. Start a fresh run, or resume it with the lathe that wrote it. ({e})") from None


def find_resume_dir(trainer_cfg) -> Path | None:
    """The checkpoint to resume from per `trainer.resume_mode` (auto | disable | resume_path: `resume_point`), or
    None; verified against its manifest (`verified_for_resume`)."""
    path = resume_point(trainer_cfg)
    return None if path is None else verified_for_resume(path, trainer_cfg)


def verified_for_resume(path: Path, trainer_cfg) -> Path:
    """`path` when it verifies (or has no manifest: a warning); when damaged, with `trainer.resume_mode=auto` and
    `trainer.resume_fallback_to_verified`, the last checkpoint of the run that verifies; else the error."""
    auto = trainer_cfg.resume_mode == "auto"
    fallback = auto and trainer_cfg.resume_fallback_to_verified

    def fix(good: Path | None) -> str:
        if good is None:
            return ("restore the file from a copy, or start over with trainer.resume_mode=disable or another "
                    "trainer.default_local_dir.")
        flag = ("trainer.resume_fallback_to_verified=true (trainer.resume_mode=auto then falls back to it), or "
                if auto else "")
        return (f"resume from {good.name} with {flag}trainer.resume_mode=resume_path trainer.resume_from_path={good};"
                " or restore the file from a copy.")
    try:
        manifest.check(path, fix=fix)
    except manifest.CheckpointDamaged as e:
        if not (fallback and e.last_good is not None):
            raise
        log.warning("%s Resuming from %s instead (trainer.resume_fallback_to_verified=true): the steps after it "
                    "are trained again; %s is left as it is for you to inspect.", e.problem, e.last_good, path.name)
        return e.last_good
    return path


def _step_dirs(root: Path) -> list[Path]:
    return [p for p in root.glob("global_step_*") if p.is_dir() and p.name.split("_")[-1].isdigit()]


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])
