"""Surviving a lost worker: with `trainer.restart_on_worker_failure = k > 0`, a worker group that loses a rank (its
process died, or it stopped answering within `actor_rollout_ref.nccl_timeout`) is stopped, started again, and
loaded from the last checkpoint, and training goes on from there, at most k times. The steps after that
checkpoint are trained again from the same state (the dataloader position, RNG and KL controller come from it),
so no prompt is skipped and none is trained twice into the weights. Errors raised by lathe's own code on a rank
(bad input, a failing reward) are not retried: they would fail again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from lathe.ckpt.checkpoint import LATEST, step_dir, verified_for_resume
from lathe.cluster.worker_group import WorkerGroupError
from lathe.loop.setup import Trainer, resume

log = logging.getLogger("lathe")


def run_with_restarts(t: Trainer, fit_once: Callable[[Trainer, bool], dict]) -> dict:
    """`fit_once(t, first)` until it returns, restarting the workers after a lost rank (see the module)."""
    limit, restarts = t.cfg.trainer.restart_on_worker_failure, 0
    while True:
        try:
            return fit_once(t, restarts == 0)
        except WorkerGroupError as e:
            if t.cluster is None or restarts >= limit:
                if limit and t.cluster is not None:
                    e.add_note(f"(the workers were restarted {restarts} time(s), "
                               f"trainer.restart_on_worker_failure={limit})")
                raise
            restarts += 1
            path = last_checkpoint(t)
            log.warning("workers lost at step %d (%s); restart %d of %d from %s", t.global_step, e, restarts, limit,
                        path)
            t.cluster = t.cluster.restart()
            t.worker, t.critic, t.reward_model = t.cluster.actor, t.cluster.critic, t.cluster.reward_model
            resume(t, path)
            t.tracker.truncate_after(t.global_step)


def last_checkpoint(t: Trainer) -> Path:
    root = Path(t.cfg.trainer.default_local_dir).expanduser()
    latest = root / LATEST
    if not latest.exists():
        raise WorkerGroupError(f"a worker was lost at step {t.global_step} and trainer.restart_on_worker_failure="
                               f"{t.cfg.trainer.restart_on_worker_failure} asks to restart from the last checkpoint, "
                               f"but {root} has none yet. Set trainer.save_freq so that there is one to restart from.")
    return verified_for_resume(step_dir(root, int(latest.read_text().strip())), t.cfg.trainer)
