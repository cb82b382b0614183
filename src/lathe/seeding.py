"""Seeding every generator a run draws from (Python's, NumPy's, torch's): the driver and every rank seed alike."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
