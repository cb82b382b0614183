"""Fully-async training's trainer thread: one local update on a batch of finished groups (`learn_batch`), which
`lathe.loop.fully_async` runs beside the driver's loop, and whether PPO's old log-probs are the engine's."""

from __future__ import annotations

import time

from lathe.algo import rollout_probs_diff
from lathe.batch import Batch
from lathe.loop.ppo import finish_metrics, learn
from lathe.loop.sampling import score_batch
from lathe.loop.setup import Trainer
from lathe.track import PeakMemory, Timer


def learn_batch(t: Trainer, batch: Batch, current: int | None) -> dict[str, float]:
    """One local update on a batch of finished groups (run in the trainer thread). `current`: the rollout's weight
    version when the trainer holds exactly those weights (the first update after a sync), else None; the tokens
    sampled with it must then have the log-probs the trainer recomputes (`rollout_probs_diff_current_*`).
    With a reward model (`reward_model.enable`) the batch comes unscored and is scored here first, on the trainer
    pool's ranks or the reward model's own pool (`t.reward_model` goes to either), as the synchronous loop scores its
    step (`score_batch`: the same scores and metrics); the teachers' log-probs likewise (`learn`)."""
    timer = Timer(memory=PeakMemory(t.device), energy=t.energy)
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if t.reward_model is not None:
        with timer("reward"):
            scores, metrics = score_batch(t, batch)
        batch.update(scores)
    old_from_rollout = old_log_probs_from_rollout(t.cfg)
    batch, learned = learn(t, batch, timer, old_from_rollout=old_from_rollout,
                           skip_on_policy=False)                          # the diff below reads the old log-probs
    metrics.update(learned)
    if current is not None and not old_from_rollout:
        same = batch["response_mask"].bool() & (batch["rollout_versions"] == current)
        metrics.update({f"fully_async/rollout_probs_diff_current_{k}": v for k, v in rollout_probs_diff(
            batch["old_log_probs"], batch["rollout_log_probs"], same).items()})
    return finish_metrics(t, batch, timer, metrics, time.perf_counter() - start)


def old_log_probs_from_rollout(cfg) -> bool:
    """PPO's old log-probs are the engine's (verl: use_rollout_log_probs without compute_prox_log_prob, or the
    rollout correction's bypass mode); else the trainer recomputes them (the proximal policy of decoupled PPO)."""
    at = cfg.async_training
    return cfg.algorithm.rollout_correction.bypass_mode or (at.use_rollout_log_probs and not at.compute_prox_log_prob)
