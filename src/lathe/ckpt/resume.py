"""Which checkpoint a run resumes from (`trainer.resume_mode`), found from the file system alone.

No torch here, so that `lathe train` and `lathe sft` find a resume path that names no checkpoint before anything
loads (`lathe.loop.preflight`); verifying the checkpoint against its manifest and reading it is
`lathe.ckpt.checkpoint`'s (`find_resume_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path

from lathe.ckpt import manifest

LATEST = "latest_checkpointed_iteration.txt"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def resume_point(trainer_cfg) -> Path | None:
    """The step directory `trainer.resume_mode` (auto | disable | resume_path) names, or None (a fresh start); a
    FileNotFoundError, with the fix, when it names one that is not a checkpoint."""
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = Path(trainer_cfg.resume_from_path).expanduser()
        if not is_checkpoint(path):
            raise FileNotFoundError(f"trainer.resume_from_path={trainer_cfg.resume_from_path!r} is not a checkpoint "
                                    "directory (it must hold trainer_state.pt, e.g. .../global_step_20)")
        return path
    root = Path(trainer_cfg.default_local_dir).expanduser()
    latest = root / LATEST
    if not latest.exists():
        return None
    path = step_dir(root, int(latest.read_text().strip()))
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{latest} names {path.name}, which is missing or incomplete; delete {latest} "
                                "to start over or set trainer.resume_mode=resume_path with another checkpoint")
    return path


def is_checkpoint(path: Path) -> bool:
    """A step directory: its trainer state, or a manifest (which names what is missing when that is)."""
    return (path / "trainer_state.pt").exists() or (path / manifest.MANIFEST).exists()


def check_lora(path: Path, roles: dict[str, tuple[str, int]]) -> None:
    """The checkpoint `path` trained each role of `roles` (its directory name -> the LoRA-rank key of this run and
    its value) with the LoRA this run asks for: a role saved without `lora_adapter/` resumes at rank 0 only, one
    saved with it at its adapter's rank; else a ValueError with the fix, before anything loads."""
    for role, (key, rank) in roles.items():
        if not (path / role).is_dir():
            continue
        saved = adapter_rank(path / role / "lora_adapter")
        if (saved or 0) == rank:
            continue
        model_key = key.rsplit(".", 1)[0] + ".path"
        if saved is None:
            fix = (f"resume with {key}=0, or start a new run with LoRA from its weights ({model_key}="
                   f"{path / role / 'huggingface'}, trainer.resume_mode=disable)")
        elif rank == 0:
            fix = (f"resume with {key}={saved}, or start a new run from its merged weights ({model_key}="
                   f"{path / role / 'huggingface'}, trainer.resume_mode=disable)")
        else:
            fix = f"resume with {key}={saved}"
        how = "without LoRA" if saved is None else f"with LoRA of rank {saved}"
        raise ValueError(f"checkpoint {path / role} was saved {how}, but this run has {key}={rank}: its optimizer "
                         f"state would not fit. Fix: {fix}.")


def adapter_rank(adapter: Path) -> int | None:
    """The rank `r` of a PEFT adapter directory (its adapter_config.json), None when there is none."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        return int(json.loads(config.read_text()).get("r", 0)) or None
    except (ValueError, TypeError, OSError):
        return None
