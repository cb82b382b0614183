"""Which checkpoint a run resumes from (`trainer.resume_mode`), found from the file system alone.

No torch here, so that `lathe train` and `lathe sft` find a resume path that names no checkpoint before anything
loads (`lathe.loop.preflight`); verifying the checkpoint against its manifest and reading it is
`lathe.ckpt.checkpoint`'s (`find_resume_dir`).
"""

from __future__ import annotations

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
