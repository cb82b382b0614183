"""Producing a step's scored samples: rollout, reward, DAPO's dynamic sampling, ReMax's greedy baseline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from lathe.algo import filter_groups
from lathe.batch import Batch
from lathe.loop.reward_async import BackgroundScoring, snapshot
from lathe.loop.setup import Trainer, prompt_batch
from lathe.engine.speculative import SPEC_MEANS, SPEC_TOTALS, merge_spec_metrics
from lathe.loop.steps import compute_reward
from lathe.rollout.base import concat_rollouts
from lathe.seeding import derive_seed
from lathe.workers.judge import timed_judge

SUMMED_ROLLOUT_METRICS = ("rollout/num_preemptions", "rollout/graph_captures", "rollout/prefill_tokens",
                          "timing_s/rollout_wake_up", "timing_s/rollout_sleep", "timing_s/graph_capture",
                          "timing_s/rollout_device_wait")


class DynamicSamplingExhausted(ValueError):
    """DAPO's dynamic sampling used `max_num_gen_batches` generation rounds without filling the batch."""


def generate_and_score(t: Trainer, prompts: Batch, timer, round_: int = 0, pending: BackgroundScoring | None = None
                       ) -> tuple[Batch, dict[str, float]]:
    """`rollout.n` responses per prompt with their rewards (and ReMax baselines when that estimator is used).

    The samples are seeded by (trainer.seed, step, generation round): the same on one device or many, and after
    a resume. With `pending` (`reward_model.launch_reward_fn_async`: `lathe.loop.reward_async`) the CPU scoring is
    submitted to it and the scores join the batch at its join, before the advantages."""
    params = t.sampling if t.sampling.seed is not None else replace(
        t.sampling, seed=rollout_seed(t.cfg.trainer.seed, t.global_step, round_))
    with timer("gen"):
        batch = t.worker.generate_sequences(prompts, params)
    with timer("reward"):
        metrics = score_into(t, batch, pending, lambda scores: batch.update(scores))
    metrics.update(batch.meta.pop("rollout_metrics", {}))
    if t.cfg.algorithm.adv_estimator == "remax":
        with timer("gen_max"):
            greedy_baseline(t, prompts, batch, pending)
    return batch, metrics


def rollout_seed(seed: int, step: int, round_: int) -> int:
    """A well-mixed 62-bit sampling seed for one generation round of one step."""
    return derive_seed(seed, step, round_)


def greedy_baseline(t: Trainer, prompts: Batch, batch: Batch, pending: BackgroundScoring | None = None) -> None:
    """ReMax (Li et al. 2023): the reward of one greedy response per prompt, repeated for its n samples, into
    `batch["reward_baselines"]`."""
    greedy = t.worker.generate_sequences(prompts, replace(t.sampling, n=1, do_sample=False))

    def baselines(scores: Batch) -> None:
        batch["reward_baselines"] = scores["seq_scores"].repeat_interleave(t.sampling.n)
    score_into(t, greedy, pending, baselines, overlong=False, phase="gen_max")


def score_into(t: Trainer, batch: Batch, pending: BackgroundScoring | None, use: Callable[[Batch], object], *,
               overlong: bool = True, phase: str = "reward") -> dict[str, float]:
    """Score `batch` (`score_batch`) and hand the scores to `use`; returns the metrics. With `pending` the CPU
    scoring (of a snapshot of the batch) is submitted to `pending` (its seconds to `phase`), `use` runs at its join
    and the scoring's metrics come with the join's; a reward model's or judge's device pass runs now, before it,
    unless the model has devices of its own (`reward_model.enable_resource_pool`): then the pass is part of the
    background job and overlaps the step's log-prob passes on the actor's devices."""
    if pending is None:
        scores, metrics = score_batch(t, batch, overlong=overlong)
        use(scores)
        return metrics
    t.reward.start()                             # fork its workers from this thread, not the background one
    fields = snapshot(batch)
    pool = getattr(t.cluster, "reward_group", None)
    if pool is not None:                         # the model's devices are its own: its pass goes to the background too
        metrics, model_bound_s = {}, pool.timeout_s
        run = lambda: score_batch(t, fields, overlong=overlong)   # noqa: E731
    else:                                        # on the actor's devices: now, between the step's device passes
        kw, metrics = model_scores(t, batch, overlong=overlong)
        model_bound_s = 0.0
        run = lambda: compute_reward(fields, t.tokenizer, t.reward, **kw)   # noqa: E731

    def apply(result: tuple[Batch, dict[str, float]]) -> dict[str, float]:
        use(result[0])
        return result[1] if phase == "reward" else {}       # as the foreground path keeps them
    pending.submit(phase, run, apply, manager=t.reward, num_samples=len(batch), extra_bound_s=model_bound_s)
    return metrics


def score_batch(t: Trainer, batch: Batch, *, overlong: bool = True) -> tuple[Batch, dict[str, float]]:
    """Each response's reward: the rule scorers', a learned reward model's (`reward_model.enable`), or a generative
    judge's (`reward_model.judge.enable`) alone or joined with the rule's (`judge.combine`); with the judge's
    metrics (`reward_judge/*`, `timing_s/reward_judge`). `overlong`: DAPO's overlong shaping as configured."""
    kw, judge_metrics = model_scores(t, batch, overlong=overlong)
    scores, metrics = compute_reward(batch, t.tokenizer, t.reward, **kw)
    return scores, {**metrics, **judge_metrics}


def model_scores(t: Trainer, batch: Batch, *, overlong: bool = True) -> tuple[dict, dict[str, float]]:
    """The device part of `score_batch`: (`compute_reward`'s keyword arguments, the judge's metrics), with a reward
    model's or judge's scores when one is enabled."""
    rm, kw, judge_metrics = t.reward_model, {}, {}
    if overlong:
        kw = dict(overlong=t.cfg.reward_model.overlong_buffer, max_response_length=t.cfg.data.max_response_length)
    if rm is not None and t.cfg.reward_model.judge.enable:
        judge = t.cfg.reward_model.judge
        out, judge_metrics = timed_judge(rm, batch, t.device)
        kw.update(rm_scores=out["judge_scores"], combine=(judge.combine, judge.weight))
    elif rm is not None:
        kw.update(rm_scores=rm.compute_rm_score(batch)["rm_scores"])
    return kw, judge_metrics


def sample_step_batch(t: Trainer, prompts: Batch, timer, pending: BackgroundScoring | None = None
                      ) -> tuple[Batch, dict[str, float]]:
    """The step's batch; with `algorithm.filter_groups.enable`, DAPO's dynamic sampling (which reads the scores:
    it takes no `pending`). With `pending`, the scores join the batch at its join (`generate_and_score`).

    Each generation round takes one dataloader batch of `data.gen_batch_size` prompts (verl's DAPO recipe;
    = train_batch_size unless set). Groups whose `filter_groups.metric` has zero variance (all right or all
    wrong: no GRPO signal) are dropped and further rounds generated until `train_batch_size` prompts remain,
    at most `max_num_gen_batches` rounds (0 = no limit); the first `train_batch_size` kept groups train.
    """
    fg = t.cfg.algorithm.filter_groups
    if pending is not None and fg.enable:
        raise ValueError("sample_step_batch: DAPO's dynamic sampling reads the scores, which cannot wait for a join")
    batch, metrics = generate_and_score(t, prompts, timer, pending=pending)
    if not fg.enable:
        return batch, metrics
    want = t.cfg.data.train_batch_size * t.sampling.n
    kept, rounds = [], 1
    while True:
        keep = filter_groups(batch["uid"], group_metric(batch, fg.metric))
        kept.append(batch.select(keep))
        have = sum(len(b) for b in kept)
        if have >= want:
            break
        if 0 < fg.max_num_gen_batches <= rounds:
            raise DynamicSamplingExhausted(
                f"algorithm.filter_groups: after {rounds} generation rounds (max_num_gen_batches="
                f"{fg.max_num_gen_batches}) only {have // t.sampling.n} of data.train_batch_size="
                f"{t.cfg.data.train_batch_size} prompts had reward variance within their group. The policy "
                "is solving (or failing) nearly every prompt: raise max_num_gen_batches (0 = no limit), use "
                "harder/easier data, or disable filter_groups.")
        rounds += 1
        batch, more = generate_and_score(t, prompt_batch(t.next_rows(), t.global_step, round_=rounds), timer,
                                         round_=rounds)
        for key in more:                            # counts and seconds are summed over all rounds
            if key in SUMMED_ROLLOUT_METRICS:
                more[key] += metrics.get(key, 0)
        merge_spec_metrics(metrics, more)           # (speculative decoding's acceptance: over all rounds)
        metrics.update({k: v for k, v in more.items() if k not in SPEC_TOTALS and k not in SPEC_MEANS})
    metrics["train/num_gen_batches"] = rounds
    return concat_rollouts(kept, t.tokenizer.pad_token_id).select(slice(0, want)), metrics


def group_metric(batch: Batch, metric: str | None) -> torch.Tensor:
    """One number per row for dynamic sampling: `acc` (a scorer's `acc` extra, else the score),
    `score`/`seq_reward` (the score) or `seq_final_reward` (the reward after shaping)."""
    if metric in (None, "acc"):
        return batch["acc"] if "acc" in batch else batch["seq_scores"]
    if metric in ("score", "seq_reward", "seq_final_reward"):
        return batch["token_level_scores"].sum(-1)
    raise ValueError(f"algorithm.filter_groups.metric={metric!r}: use acc, score, seq_reward or seq_final_reward")
