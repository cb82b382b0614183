"""Shared random-batch builders for the algo tests: float64, ragged right-padded responses."""

import numpy as np
import pytest
import torch


def _ragged_mask(rng: np.random.Generator, batch: int, width: int, min_len: int = 1) -> torch.Tensor:
    lengths = rng.integers(min_len, width + 1, size=batch)
    lengths[0] = width  # at least one full row
    mask = np.arange(width)[None, :] < lengths[:, None]
    return torch.tensor(mask, dtype=torch.float64)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def ragged_mask(rng):
    """ragged_mask(batch, width, min_len=1) -> (B, T) float64 0/1 mask with random response lengths."""
    return lambda batch, width, min_len=1: _ragged_mask(rng, batch, width, min_len)


@pytest.fixture
def randn(rng):
    """randn(*shape, scale=1.0) -> float64 tensor of N(0, scale^2) draws."""
    return lambda *shape, scale=1.0: torch.tensor(rng.normal(0.0, scale, size=shape), dtype=torch.float64)


@pytest.fixture
def outcome_batch(rng, ragged_mask):
    """Outcome-reward batch: 4 prompts x group sizes (3, 4, 1, 2); the score sits on the last valid token."""
    sizes = [3, 4, 1, 2]
    index = np.array([f"uid{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    batch, width = len(index), 7
    mask = ragged_mask(batch, width)
    scores = rng.integers(0, 3, size=batch).astype(np.float64) + rng.normal(0, 0.1, size=batch)
    rewards = torch.zeros(batch, width, dtype=torch.float64)
    last = mask.sum(dim=1).long() - 1
    rewards[torch.arange(batch), last] = torch.tensor(scores)
    return {"rewards": rewards, "mask": mask, "index": index, "scores": scores}
