"""`reward_model.launch_reward_fn_async`: a step's CPU scoring runs in a background thread while the step goes on
with its old-log-prob, reference, teacher and value passes; the step joins the scores just before the advantages.

What runs in the background is the reward manager's work: the rule scorers, a custom reward function (in the
manager's worker processes, or in this thread with `reward.timeout_s=0`) and the code sandbox it calls. A learned
reward model or an LLM judge (`reward_model.enable`, `reward_model.judge.enable`) colocated with the actor computes
its scores on the devices the actor's passes use too: it stays in the foreground, right after generation as in the
synchronous step, and only the rule scoring joined with its scores (`judge.combine`) moves to the background. On
devices of its own (`reward_model.enable_resource_pool`) its pass is part of the background job: the reward model's
pool scores while the trainer's devices run the old-log-prob, reference, teacher and value passes.
Teachers (on-policy distillation) are log-prob passes of their own and stay where they are.

The scores are the same as the foreground path's: the job scores a snapshot of the batch's fields taken when it is
submitted (so a later pass that replaces a field, such as rollout rejection replacing `response_mask`, cannot change
them), the jobs run one after another in submission order (the reward manager's error streak and counts see the same
calls in the same order), and the results are applied to the batch in the driver's thread at the join.

At the join an exception of a job is raised again as it is (the foreground path's message and type), and a job
that has not finished within its bound raises `RewardScoringTimeout` naming the scorer, so the step cannot hang.
`timing_s/reward` keeps meaning the scoring's own seconds (ReMax's greedy responses' scoring goes to `gen_max`, as in
the foreground path); `timing_s/reward_wait` is how long the step waited for it at the join (verl logs no such
figure: its `timing_s/reward` times only the launch, and the wait falls into `timing_s/adv`).

DAPO's dynamic sampling (`algorithm.filter_groups.enable`) chooses the step's samples by their scores before any
log-prob pass, so it scores in the foreground (the config registry says so once at start-up, as verl's DAPO trainer
also scores in the foreground); fully-asynchronous training already scores each request on the driver while the
trainer pool trains.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from lathe.batch import Batch

SLACK_S = 60.0               # added to the workers' worst case: forking, decoding, the pipe round trips
IN_PROCESS_BOUND_S = 3600.0  # reward.timeout_s=0 bounds no sample; the join still waits no longer than this


class RewardScoringTimeout(TimeoutError):
    """Background scoring did not finish within its bound (the message names the scorer and the fix)."""


def overlaps_reward(cfg) -> bool:
    """Whether the synchronous step scores in the background (`reward_model.launch_reward_fn_async`, without DAPO's
    dynamic sampling, which needs the scores to choose the samples)."""
    return cfg.reward_model.launch_reward_fn_async and not cfg.algorithm.filter_groups.enable


def scoring_bound_s(manager, num_samples: int) -> tuple[float, str]:
    """(seconds, why): how long scoring `num_samples` responses may take at most with the reward manager's settings
    (each sample at most `reward.timeout_s`, `reward.num_workers` at a time, plus SLACK_S)."""
    if manager.timeout_s <= 0:
        return IN_PROCESS_BOUND_S, (f"reward.timeout_s=0 scores in-process with no per-sample bound, so the join waits "
                                    f"at most {IN_PROCESS_BOUND_S:.0f} s")
    if getattr(manager, "one_call", False):     # the batch manager: one call for all, timeout_s per sample
        return manager.timeout_s * num_samples + SLACK_S, (
            f"reward.timeout_s={manager.timeout_s:g} per sample, {num_samples} samples in one call of the batch "
            f"reward manager, plus {SLACK_S:.0f} s")
    rounds = math.ceil(num_samples / manager.num_workers)
    bound = manager.timeout_s * rounds + SLACK_S
    return bound, (f"reward.timeout_s={manager.timeout_s:g} per sample, {rounds} samples per process over "
                   f"reward.num_workers={manager.num_workers}, plus {SLACK_S:.0f} s")


def snapshot(batch: Batch) -> Batch:
    """A batch holding the same field objects as `batch` now: fields the step adds or replaces later stay out."""
    return Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))


@dataclass
class _Job:
    phase: str                                  # the timer phase its seconds go to
    scorer: str                                 # named by a timeout
    num_samples: int
    bound_s: float
    why: str
    run: Callable[[], object]
    apply: Callable[[object], dict]             # the result into the batch (driver thread); returns metrics
    future: Future = field(default_factory=Future)
    seconds: float = 0.0
    deadline: float = 0.0


class BackgroundScoring:
    """The jobs of one step, run one after another in a daemon thread (a hung scorer cannot keep the process
    alive at exit); `join` applies their results in submission order."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._jobs: list[_Job] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, phase: str, run: Callable[[], object], apply: Callable[[object], dict], *, manager,
               num_samples: int, extra_bound_s: float = 0.0) -> None:
        """Start `run()` after the jobs already submitted; its bound comes from `manager` (the reward manager), plus
        `extra_bound_s` (a reward model's pool's own deadline when its pass is part of the job)."""
        bound, why = scoring_bound_s(manager, num_samples)
        if extra_bound_s:
            bound, why = bound + extra_bound_s, f"{why}, plus the reward model's pool's {extra_bound_s:.0f} s"
        start = max([self._clock()] + [j.deadline for j in self._jobs])       # it may wait for the ones before it
        job = _Job(phase, manager.name, num_samples, bound, why, run, apply, deadline=start + bound)
        self._jobs.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="lathe-reward-async", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                result = job.run()
            except BaseException as e:      # re-raised in the driver's thread at the join
                job.seconds = time.perf_counter() - start
                job.future.set_exception(e)
            else:
                job.seconds = time.perf_counter() - start
                job.future.set_result(result)

    def join(self, timer) -> dict[str, float]:
        """Wait for every job (each at most until its deadline), apply the results; the jobs' seconds go to their
        phases of `timer` and the wait to `reward_wait`. Returns the jobs' metrics."""
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        try:
            for job in self._jobs:
                try:
                    result = job.future.result(timeout=max(0.0, job.deadline - self._clock()))
                except FutureTimeout:
                    raise RewardScoringTimeout(
                        f"reward_model.launch_reward_fn_async: the background scoring of {job.num_samples} responses "
                        f"by the reward function {job.scorer} did not finish within {job.bound_s:.0f} s ({job.why}); "
                        "the step stops instead of waiting forever. Fix: find what makes the scorer hang, set "
                        "reward.timeout_s > 0 so that a hung sample is killed and scored 0, or set "
                        "reward_model.launch_reward_fn_async=false to score in the foreground.") from None
                finally:
                    timer.add(job.phase, job.seconds)
                metrics.update(job.apply(result))
        finally:
            timer.add("reward_wait", time.perf_counter() - start)
            self.close()
        return metrics

    def close(self) -> None:
        """Let the thread end after its current job (idempotent; a joined step calls it itself)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None
        self._jobs = []
