"""The synchronous PPO-family driver: one screen, top to bottom, only named steps.

    prompts -> rollout -> reward -> old log-probs -> (ref log-probs) -> advantages -> actor update
"""

from __future__ import annotations

import time

from lathe.batch import Batch
from lathe.ckpt.checkpoint import save_checkpoint
from lathe.loop.setup import Trainer, prompt_batch
from lathe.loop.steps import compute_advantage, compute_data_metrics, compute_reward, compute_throughput_metrics
from lathe.loop.validate import validate
from lathe.track import ProgressBar, Timer


def train_step(t: Trainer, prompts: Batch) -> dict[str, float]:
    """One RL iteration on a batch of prompts; returns the step's metrics (verl's names)."""
    timer, metrics = Timer(), {}
    start = time.perf_counter()
    with timer("gen"):
        batch = t.worker.generate_sequences(prompts, t.sampling)
    with timer("reward"):
        scores, reward_metrics = compute_reward(batch, t.tokenizer, t.reward)
        batch.update(scores)
    with timer("old_log_prob"):
        batch.update(t.worker.compute_log_prob(batch))
    if t.worker.ref is not None:
        with timer("ref"):
            batch.update(t.worker.compute_ref_log_prob(batch))
    with timer("adv"):
        advantages, adv_metrics = compute_advantage(batch, t.cfg.algorithm, t.kl_ctrl)
        batch.update(advantages)
    with timer("update_actor"):
        actor_metrics = t.worker.update_actor(batch)
    step_seconds = time.perf_counter() - start
    metrics.update(reward_metrics, **adv_metrics, **actor_metrics)
    metrics.update(compute_data_metrics(batch, max_response_length=t.cfg.data.max_response_length))
    metrics.update(timer.metrics(), **{"timing_s/step": step_seconds})
    metrics.update(compute_throughput_metrics(batch, step_seconds))
    return metrics


def fit(t: Trainer) -> dict[str, float]:
    """Train until `total_steps`; validate every `test_freq` and save every `save_freq` steps."""
    tr = t.cfg.trainer
    bar = ProgressBar(t.total_steps, initial=t.global_step, desc="train")
    last: dict[str, float] = {}
    if t.val_dataset is not None and (tr.val_before_train or tr.val_only):
        t.tracker.log(validate(t), step=t.global_step)
    if tr.val_only:
        return {}
    while t.global_step < t.total_steps:
        rows = next_rows(t)
        t.global_step += 1
        last = train_step(t, prompt_batch(rows, t.global_step))
        done = t.global_step >= t.total_steps
        if tr.test_freq > 0 and t.val_dataset is not None and (t.global_step % tr.test_freq == 0 or done):
            last.update(validate(t))
        t.tracker.log(last, step=t.global_step)
        bar.update(t.global_step, last)
        if tr.save_freq > 0 and (t.global_step % tr.save_freq == 0 or done):
            save(t)
    bar.close()
    return last


def next_rows(t: Trainer) -> list[dict]:
    """The next dataloader batch, starting a new epoch when one runs out."""
    if t.notes.get("iterator") is None:
        t.notes["iterator"] = iter(t.loader)
    try:
        return next(t.notes["iterator"])
    except StopIteration:
        t.notes["iterator"] = iter(t.loader)
        return next(t.notes["iterator"])


def save(t: Trainer) -> None:
    state = {"dataloader": t.loader.state_dict(), "kl_ctrl": t.kl_ctrl.state_dict()}
    save_checkpoint(t.cfg.trainer.default_local_dir, t.global_step, t.worker, state,
                    max_to_keep=t.cfg.trainer.max_actor_ckpt_to_keep)
