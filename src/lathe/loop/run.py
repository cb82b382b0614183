"""`lathe train`'s driver: the synchronous PPO-family loop (`lathe.loop.ppo`); when the rollout has devices of its
own, the fully asynchronous one (`lathe.loop.fully_async`); with verl V1's `trainer.v1.trainer_mode=colocate_async`,
the colocated asynchronous one (`lathe.loop.colocate_async`)."""

from __future__ import annotations

from lathe.config import is_colocate_async
from lathe.loop import ppo
from lathe.loop.colocate_async import fit_colocated
from lathe.loop.fully_async import fit_async
from lathe.loop.setup import Trainer


def fit(t: Trainer) -> dict[str, float]:
    """Train until `t.total_steps`; returns the last step's metrics."""
    if t.plan.is_async:
        return fit_async(t)
    return fit_colocated(t) if is_colocate_async(t.cfg) else ppo.fit(t)
