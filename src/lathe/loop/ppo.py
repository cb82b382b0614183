"""The synchronous PPO-family driver: one screen, top to bottom, only named steps.

    prompts -> rollout -> reward -> old log-probs -> (rollout correction) -> (ref log-probs) -> (teacher log-probs)
            -> (values)
            -> advantages -> (PF-PPO's redraw) -> (critic update) -> actor update -> weights into the rollout
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lathe.algo import rollout_probs_diff, variance_proxy_metrics
from lathe.algo.rollout_correction import in_update
from lathe.batch import Batch
from lathe.ckpt.checkpoint import save_checkpoint
from lathe.config.profiler import torch_memory_settings, trains_checkpointed
from lathe.loop.dump import dump_rollouts
from lathe.loop.oom import explain as explain_oom
from lathe.loop.recover import run_with_restarts
from lathe.loop.reward_async import BackgroundScoring, overlaps_reward
from lathe.loop.setup import Trainer, prompt_batch
from lathe.loop.sampling import sample_step_batch
from lathe.loop.steps import (
    apply_rollout_correction,
    compute_advantage,
    compute_data_metrics,
    compute_throughput_metrics,
    resample_by_score,
    rollout_correction_enabled,
    rollout_correction_kwargs,
)
from lathe.loop.validate import validate
from lathe.track import PeakMemory, Progress, Timer, brief
from lathe.track.collector import CollectorPauses, FreezeAfterWarmup
from lathe.track.profile import StepProfiler


def train_step(t: Trainer, prompts: Batch) -> dict[str, float]:
    """One RL iteration on a batch of prompts; returns the step's metrics (verl's names)."""
    return timed_step(t, lambda timer: _train_step(t, prompts, timer))


def timed_step(t: Trainer, body: Callable[[Timer], dict[str, float]]) -> dict[str, float]:
    """A step's `body(timer)`, its phases timed (with peak memory and energy) and the collector's pauses counted
    (`timing_s/gc`); running out of device memory names the phase and the keys that lower it (`lathe.loop.oom`)."""
    timer = Timer(memory=PeakMemory(t.device), energy=t.energy)
    with CollectorPauses() as pauses:
        try:
            metrics = body(timer)
        except torch.OutOfMemoryError as e:
            raise explain_oom(e, timer.failed_phase) from e
    return {**metrics, **pauses.metrics()}


def _train_step(t: Trainer, prompts: Batch, timer: Timer) -> dict[str, float]:
    start = time.perf_counter()
    pending = BackgroundScoring() if overlaps_reward(t.cfg) else None  # reward_model.launch_reward_fn_async
    try:
        batch, sample_metrics = sample_step_batch(t, prompts, timer, pending)   # rollout + reward (+ DAPO, ReMax)
        batch, metrics = learn(t, batch, timer, old_from_rollout=t.cfg.algorithm.rollout_correction.bypass_mode,
                               pending=pending)
    finally:
        if pending is not None:
            pending.close()
    if t.global_step >= t.cfg.trainer.critic_warmup:
        with timer("update_weights"):                        # into the rollout, for the next step
            t.worker.sync_weights()
    return finish_metrics(t, batch, timer, {**sample_metrics, **metrics}, time.perf_counter() - start)


def learn(t: Trainer, batch: Batch, timer: Timer, *, old_from_rollout: bool, skip_on_policy: bool = True,
          pending: BackgroundScoring | None = None) -> tuple[Batch, dict[str, float]]:
    """Everything a step does with its scored samples: old (or the rollout's) log-probs, rollout correction,
    reference log-probs, the teachers' log-probs (on-policy distillation), values, advantages, PF-PPO's redraw,
    critic and actor updates; returns the batch the updates trained on, and the metrics. `batch` gains the tensors
    on the way; it is the batch returned, except with `algorithm.use_pf_ppo`: then a redraw of its rows
    (`resample_by_score`), which the step's data metrics then describe, as verl's. The metrics say where pi_old came
    from:
    `training/old_log_prob_forward` 1 when a forward pass of its own computed it (`timing_s/old_log_prob`),
    `training/old_log_prob_from_rollout` 1 when the engine's log-probs serve; both 0: the on-policy update's own
    forward (the pass skipped).
    `skip_on_policy`: leave the old-policy forward to the actor update when the step is on-policy
    (`needs_old_forward`); a caller that reads `old_log_probs` afterwards passes False.
    `pending`: scoring still running in the background (`lathe.loop.reward_async`), joined before the advantages."""
    rc = t.cfg.algorithm.rollout_correction
    forward = not old_from_rollout and (not skip_on_policy or needs_old_forward(t, batch))
    # which pi_old the update uses (issue 48): a forward pass of its own, the engine's log-probs, or neither of
    # them set: the on-policy update's own forward (no separate pass; `needs_old_forward`)
    metrics = {"training/old_log_prob_forward": float(forward), "training/old_log_prob_from_rollout":
               float(old_from_rollout)}
    if old_from_rollout:                                                 # the rollout's log-probs are pi_old
        batch["old_log_probs"] = batch["rollout_log_probs"]
        if t.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:      # the OTB estimator's input: one forward
            with timer("old_log_prob"):
                batch["sum_pi_squared"] = t.worker.compute_log_prob(batch)["sum_pi_squared"]
    elif forward:
        with timer("old_log_prob"):
            batch.update(t.worker.compute_log_prob(batch))
        if "rollout_log_probs" in batch:                                 # verl's engine-vs-trainer check
            metrics.update({f"training/rollout_probs_diff_{k}": v for k, v in rollout_probs_diff(
                batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]).items()})
    # without old log-probs the on-policy update corrects against its own forward (`needs_old_forward`)
    corrects_in_update = not old_from_rollout and rollout_correction_enabled(rc) and "old_log_probs" not in batch
    if not old_from_rollout and rollout_correction_enabled(rc) and not corrects_in_update:
        correction, rc_metrics = apply_rollout_correction(batch, rc)
        batch.update(correction)
        metrics.update(rc_metrics)
    if t.worker.has_ref:
        with timer("ref"):
            batch.update(t.worker.compute_ref_log_prob(batch))
    if t.worker.has_teacher:                                             # distillation.enabled
        with timer("teacher"):
            batch.update(t.worker.compute_teacher_log_prob(batch))
    if t.critic is not None:
        with timer("values"):
            batch.update(t.critic.compute_values(batch))
    if pending is not None:                                              # the scores, from the background
        metrics.update(pending.join(timer))
    with timer("adv"):
        advantages, adv_metrics = compute_advantage(batch, t.cfg.algorithm, t.kl_ctrl)
        batch.update(advantages)
    metrics.update(adv_metrics)
    if t.cfg.algorithm.use_pf_ppo:                            # after the advantages, before the updates (verl)
        batch, pf_metrics = resample_by_score(batch, t.cfg.algorithm, t.cfg.trainer.seed, t.global_step)
        metrics.update(pf_metrics)
    if t.critic is not None:
        with timer("update_critic"):
            metrics.update(t.critic.update_critic(batch))
    if t.global_step >= t.cfg.trainer.critic_warmup:          # verl: the critic may train alone first
        with timer("update_actor"):
            update = t.worker.update_actor(batch)
        if corrects_in_update and not any(k.startswith("rollout_corr/") for k in update):
            raise RuntimeError("the actor update computed no rollout correction, which this step left to it "
                               "(algorithm.rollout_correction is on and the old-policy pass was skipped): its worker "
                               "was built without the algorithm.rollout_correction keys")
        metrics.update(update)
    return batch, metrics


def needs_old_forward(t: Trainer, batch: Batch) -> bool:
    """Whether the step needs the old policy's log-probs before the actor update. An on-policy update (one epoch,
    the whole batch one mini-batch) does not: pi_old is the policy it updates, whose log-probs its own forward
    computes (verl's dp_actor then uses them, detached, in place of the recomputed ones). So the forward is saved
    unless something else reads `old_log_probs` first: the KL penalty in the reward, a rollout correction that the
    update cannot compute from its own forward (rejection sampling, batch-normalised weights: `in_update`; IS
    weights alone it computes, as FP8 rollout's default token TIS, unless LoRA dropout makes that forward differ from
    the old-policy pass's, which runs without dropout, as verl's does), an advantage estimator that reads them with
    `sum_pi_squared` (`actor.calculate_sum_pi_squared`), or an actor update that does not run this step (critic
    warm-up)."""
    algo, actor = t.cfg.algorithm, t.cfg.actor_rollout_ref.actor
    on_policy = actor.ppo_epochs == 1 and len(batch) <= t.plan.actor.mini_batch_sequences
    rc, model = algo.rollout_correction, t.cfg.actor_rollout_ref.model
    dropout = model.lora_rank > 0 and model.lora_dropout > 0
    return (not on_policy or algo.use_kl_in_reward
            or (rollout_correction_enabled(rc) and (dropout or not in_update(rollout_correction_kwargs(rc))))
            or actor.calculate_sum_pi_squared or t.global_step < t.cfg.trainer.critic_warmup)


def finish_metrics(t: Trainer, batch: Batch, timer: Timer, metrics: dict, step_seconds: float) -> dict[str, float]:
    """The step's data, timing and throughput metrics added to `metrics` (and verl's `variance_proxy/*` when the
    old-log-prob pass computed `sum_pi_squared`); the samples dumped when asked."""
    metrics.update(compute_data_metrics(batch, max_response_length=t.cfg.data.max_response_length))
    if "sum_pi_squared" in batch:                                        # actor.calculate_sum_pi_squared
        metrics.update(variance_proxy_metrics(batch["advantages"], batch["response_mask"], batch["old_log_probs"],
                                              batch["sum_pi_squared"], batch.tensors.get("rollout_is_weights"),
                                              metrics.get("actor/grad_norm")))
    metrics.update(timer.metrics(), **{"timing_s/step": step_seconds})
    metrics.update(compute_throughput_metrics(batch, step_seconds))
    dump_rollouts(t, batch)                                              # trainer.rollout_data_dir
    return metrics


def fit(t: Trainer) -> dict[str, float]:
    """Train synchronously until `total_steps`; validate every `test_freq` and save every `save_freq` steps
    (restarting lost workers from the last checkpoint when `trainer.restart_on_worker_failure` allows:
    `lathe.loop.recover`)."""
    return run_with_restarts(t, _fit)


def _fit(t: Trainer, first: bool) -> dict[str, float]:
    tr = t.cfg.trainer
    last: dict[str, float] = {}
    if first and t.val_dataset is not None and (tr.val_before_train or tr.val_only):
        t.tracker.log(validate(t), step=t.global_step)
    if tr.val_only:
        return {}
    profiler = step_profiler(t)
    # a terminal's live line; the collector's reach narrowed after the warm-up steps
    with Progress("train", t.total_steps, initial=t.global_step, every_s=None) as bar, \
            FreezeAfterWarmup(t.cluster.groups if t.cluster else []) as frozen:
        while t.global_step < t.total_steps:
            rows = t.next_rows()
            t.global_step += 1
            with profiler.step(t.global_step):
                last = train_step(t, prompt_batch(rows, t.global_step))
            done = t.global_step >= t.total_steps
            if tr.test_freq > 0 and t.val_dataset is not None and (t.global_step % tr.test_freq == 0 or done):
                last.update(validate(t))
            t.tracker.log(last, step=t.global_step)
            bar.update(t.global_step, brief(last))
            frozen.after_step(t.total_steps - t.global_step)      # outside the step's timing
            if tr.save_freq > 0 and (t.global_step % tr.save_freq == 0 or done):
                save(t)
    return last


def step_profiler(t: Trainer) -> StepProfiler:
    """The run's `global_profiler` (tool=torch / torch_memory) over its listed steps, on every worker."""
    gp = t.cfg.global_profiler
    memory = torch_memory_settings(gp.global_tool_config, checkpointing=trains_checkpointed(t.cfg))
    return StepProfiler(gp.tool, gp.steps, gp.save_path, t.device, workers=t.cluster.groups if t.cluster else [],
                        with_stack=gp.with_stack, memory=memory)


def save(t: Trainer, extra: dict | None = None) -> None:
    state = {"dataloader": t.loader.state_dict(), "kl_ctrl": t.kl_ctrl.state_dict(), **(extra or {})}
    parts = {"actor": t.worker, **({"critic": t.critic} if t.critic is not None else {})}
    save_checkpoint(t.cfg.trainer.default_local_dir, t.global_step, parts, state,
                    max_to_keep=t.cfg.trainer.max_actor_ckpt_to_keep)
