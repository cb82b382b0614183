"""Seeding every generator a run draws from (Python's, NumPy's, torch's): the driver and every rank seed alike; and
the seeds of per-step draws, derived from the run's seed and the step so that a resumed run draws as an
uninterrupted one."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def derive_seed(*parts: object) -> int:
    """A well-mixed 62-bit seed from `parts` (e.g. trainer.seed, the step, what the draw is for): the same parts give
    the same seed in any process, different parts unrelated ones."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2
