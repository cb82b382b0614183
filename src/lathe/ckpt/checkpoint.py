"""Save and resume: model, optimizer, scheduler, dataloader position and every RNG state.

Layout (verl's): `<default_local_dir>/global_step_<k>/{actor/, trainer_state.pt}` plus
`latest_checkpointed_iteration.txt`, written last, so a save cut short never becomes "latest".
`actor/huggingface/` is a plain Hugging Face checkpoint directory: transformers loads it as is.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def save_checkpoint(root: str | Path, step: int, worker, trainer_state: dict[str, Any], *,
                    max_to_keep: int | None = None) -> Path:
    """Write step `step`'s checkpoint, then mark it latest, then prune old ones beyond `max_to_keep`."""
    root = Path(root)
    path = step_dir(root, step)
    if path.exists():
        shutil.rmtree(path)
    worker.save_checkpoint(path / "actor")
    torch.save({**trainer_state, "global_step": step, "rng": capture_rng()}, path / "trainer_state.pt")
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(str(step))
    tmp.replace(root / LATEST)
    if max_to_keep:   # only steps up to this one: later ones (from a run resumed earlier) may sort above it
        for old in sorted((d for d in _step_dirs(root) if _step_of(d) <= step), key=_step_of)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", weights_only=False)


def find_resume_dir(trainer_cfg) -> Path | None:
    """The checkpoint to resume from per `trainer.resume_mode` (auto | disable | resume_path), or None."""
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = Path(trainer_cfg.resume_from_path).expanduser()
        if not (path / "trainer_state.pt").exists():
            raise FileNotFoundError(f"trainer.resume_from_path={trainer_cfg.resume_from_path!r} is not a checkpoint "
                                    "directory (it must hold trainer_state.pt, e.g. .../global_step_20)")
        return path
    root = Path(trainer_cfg.default_local_dir).expanduser()
    latest = root / LATEST
    if not latest.exists():
        return None
    path = step_dir(root, int(latest.read_text().strip()))
    if not (path / "trainer_state.pt").exists():
        raise FileNotFoundError(f"{latest} names {path.name}, which is missing or incomplete; delete {latest} "
                                "to start over or set trainer.resume_mode=resume_path with another checkpoint")
    return path


def _step_dirs(root: Path) -> list[Path]:
    return [p for p in root.glob("global_step_*") if p.is_dir() and p.name.split("_")[-1].isdigit()]


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])
