"""`lathe train`'s driver: the synchronous PPO-family loop (`lathe.loop.ppo`) or, when the rollout has devices of
its own, the fully asynchronous one (`lathe.loop.fully_async`)."""

from __future__ import annotations

from lathe.loop import ppo
from lathe.loop.fully_async import fit_async
from lathe.loop.setup import Trainer


def fit(t: Trainer) -> dict[str, float]:
    """Train until `t.total_steps`; returns the last step's metrics."""
    return fit_async(t) if t.plan.is_async else ppo.fit(t)
