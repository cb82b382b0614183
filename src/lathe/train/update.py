"""Pieces every PPO-style learner shares: the epoch/mini-batch loop, the clipped optimizer step, and
saving/loading a module with its optimizer and scheduler."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from lathe.batch import Batch


def run_ppo_epochs(batch: Batch, *, epochs: int, mini_batch_size: int,
                   update_mini_batch: Callable[[Batch], dict[str, float]]) -> dict[str, float]:
    """`epochs` passes over `batch` in mini-batches; each mini-batch's metrics averaged over all of them."""
    metrics: dict[str, list[float]] = defaultdict(list)
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            for k, v in update_mini_batch(mini).items():
                metrics[k].append(v)
    return {k: sum(v) / len(v) for k, v in metrics.items()}


def clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the gradient norm, step the optimizer unless the norm is not finite (then drop the gradient)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def save_trainable(path: Path, model, optimizer, scheduler) -> None:
    """HF-format weights under `path/huggingface` (transformers loads them) plus `path/optim.pt`."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "huggingface", safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")


def load_trainable(path: Path, model, optimizer, scheduler, *, what: str,
                   ignore_missing: Callable[[str], bool] = lambda name: False) -> None:
    """Restore what `save_trainable` wrote; weights that do not fit the model raise, naming the tensors."""
    from safetensors.torch import load_file
    files = sorted((path / "huggingface").glob("*.safetensors"))
    if not files or not (path / "optim.pt").exists():
        raise FileNotFoundError(f"{what} checkpoint {path} is incomplete: expected huggingface/*.safetensors and "
                                "optim.pt")
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not ignore_missing(m)]
    if missing or unexpected:
        raise RuntimeError(f"{what} checkpoint {path} does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    opt = torch.load(path / "optim.pt", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
