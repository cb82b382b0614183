"""verl V1's colocated asynchronous trainer (`trainer.v1.trainer_mode=colocate_async`): generation and training on
the same devices, the rollout running ahead of the trainer and its unfinished samples continued across steps.

    step s:  issue prompts (at the first step also `num_warmup_batches` batches ahead) --> every engine runs until
             train_batch_size prompt groups have finished --> the unfinished samples are interrupted (their tokens
             and log-probs kept) and the engines sleep --> the groups issued earliest train: score, old/ref log-probs,
             advantages, updates (the synchronous loop's `learn`) --> the new weights into the engines as version s
             --> step s+1 continues the interrupted samples under them (partial rollout)

Between two steps the rollout holds at most (1 + num_warmup_batches) x train_batch_size prompts, issued or finished
and not yet trained (verl's warm-up batches: a step issues as many prompts as it trains). Long responses thus
finish over several steps instead of holding every step's rollout to its longest response; a sample can mix weight
versions, each token keeping the version and the log-prob it was sampled with (`rollout_versions`). PPO's old policy
is the trainer's current one (its own forward, as verl V1 recomputes old log-probs; the engine's with
`rollout_correction.bypass_mode`); `algorithm.rollout_correction` corrects the rollout's staleness when set.

Staleness (`trainer.v1.sampler`): a group issued more than `max_off_policy_threshold` steps before the step that
would train it is dropped when it finishes (`drop`; another prompt is issued in its place) or, with `wait`, the step
waits for every in-flight group of that age to finish, which then trains. Metrics: verl V1's
`training/off_policy/{trajectory_spans,trajectory_staleness,trajectory_staleness_worst}/{mean,max,min}` and
`training/off_policy/evicted_samples`.

Agent loops (the tool loop, `multi_turn.enable`, or custom ones) run each request's trajectories through the engine's
stream (`lathe.workers.colocated_stream`): a turn in progress at a step's end is interrupted and continues under the
next weights, a tool call in flight keeps running while the step trains.

DAPO's dynamic sampling (`algorithm.filter_groups`), as verl V1 runs it in its asynchronous modes: a group whose
`filter_groups.metric` is the same for every sample (no GRPO signal) is evicted as it finishes and one fresh prompt is
issued in its place, so a step still trains `train_batch_size` groups; `training/filter_groups/evicted_samples` counts
them. Where more than `max_num_gen_batches` x `data.gen_batch_size` groups (the most the synchronous loop generates
for one step) are evicted between two steps, the run stops and says so (0: no limit).

Samples are seeded as the synchronous loop seeds the same prompt of the same step, and the engines run in slices
of engine steps, not seconds: with `num_warmup_batches=0` (nothing issued ahead, nothing interrupted) a run is the
synchronous one. A checkpoint records which issued prompts trained; a resumed run issues the others again
(their partial samples are generated afresh, under the checkpoint's weights), each prompt still trained once.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np
import torch

from lathe.algo import filter_groups
from lathe.batch import Batch
from lathe.loop.fully_async import AsyncDriver, Pace
from lathe.loop.ppo import finish_metrics, learn, save, step_profiler, timed_step
from lathe.loop.recover import run_with_restarts
from lathe.loop.sampling import DynamicSamplingExhausted, group_metric, score_batch
from lathe.loop.setup import Trainer
from lathe.loop.validate import validate
from lathe.track import Progress, Timer, brief
from lathe.track.collector import FreezeAfterWarmup

SLICE_STEPS = 32        # engine steps each replica runs between two looks at the finished groups


class ColocatedReplicas:
    """`AsyncDriver`'s handle on the trainer's own engines (a rollout pool's `RolloutGroup` methods): requests in,
    each `collect` a slice of `SLICE_STEPS` engine steps on every replica, `pause` interrupts and puts them to sleep.
    On Ray workers each engine replica (one rank, or a tensor-parallel replica's ranks, which take the same requests
    for the same engine steps) streams its own share (`ActorRolloutRefGroup.stream_run_each`)."""

    def __init__(self, t: Trainer, max_steps: int | None = None):
        self.worker, self.world = t.worker, t.plan.rollout_replicas
        self.max_steps = max_steps or SLICE_STEPS
        self.inbox: list[list[tuple]] = [[] for _ in range(self.world)]

    def submit(self, requests: dict[int, list]) -> None:
        for replica, reqs in requests.items():
            self.inbox[replica] += reqs     # (request_id, prompt ids, params, first_index, images, agent)

    def collect(self, wait_s: float = 0.0) -> tuple[list[tuple[object, Batch]], list[float]]:
        per_rank, self.inbox = self.inbox, [[] for _ in range(self.world)]
        if hasattr(self.worker, "stream_run_each"):
            answers = self.worker.stream_run_each(per_rank, self.max_steps)
        else:                                                # one process: the worker itself
            answers = [self.worker.stream_run(per_rank[0], self.max_steps)]
        return [d for a in answers for d in a["done"]], [a["busy_s"] for a in answers]

    def pause(self, partial: bool = True) -> int:
        return self.worker.stream_pause()

    def resume(self) -> None:
        """(The engines wake at the next `collect`.)"""


class ColocatedDriver(AsyncDriver):
    """`AsyncDriver` over the trainer's own engines, a step's rollout phase at a time (see the module docstring)."""

    def __init__(self, t: Trainer):
        v1, fg = t.cfg.trainer.v1, t.cfg.algorithm.filter_groups
        self.threshold, self.strategy = v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy
        step = t.plan.actor.prompts_per_step
        # one prompt per request (a group finishes on its own); dropped (stale or filtered) groups are replaced, so
        # no prompt count bounds the run then
        pace = Pace(step, step, v1.colocate_async.num_warmup_batches, chunk=1,
                    total_prompts=math.inf if self.strategy == "drop" or fg.enable else t.total_steps * step)
        super().__init__(t, rollout=ColocatedReplicas(t), pace=pace)
        self.dapo = None                # (not fully-async's rounds: each filtered group is replaced on its own)
        self.filter = fg if fg.enable else None
        self.most_filtered = fg.max_num_gen_batches * t.cfg.data.gen_batch_size   # between two steps (0: no limit)
        self.evicted: list[int] = []    # ages of the groups dropped as stale since the last trained step
        self.filtered = 0               # groups evicted by the filter since the last trained step

    def age(self, issued_at: int) -> int:
        """Steps from a prompt's issue to the step being gathered, both counted (verl V1's span)."""
        return self.step - issued_at + 1

    def gather(self) -> int:
        """The rollout phase of step `self.step`: issue prompts and run the engines until a step's groups have
        finished (dropping or waiting for stale ones), then interrupt the rest and sleep; returns how many samples
        were interrupted."""
        self._evict_stale()
        while True:
            self.fill()
            if self.ready():
                break
            if not self.in_flight:
                self.check_waiting(since=time.monotonic())      # every prompt issued: nothing can come (it says so)
                raise RuntimeError(f"colocate_async: step {self.step} has {self.queued_prompts()} of its "
                                   f"{self.step_prompts} prompt groups, none in flight, and may issue no more "
                                   f"(budget {self.budget}); this is a bug in lathe")
            self.poll(0.0)
            self._evict_stale()
        return self.rollout.pause(partial=True)

    def ready(self) -> bool:
        if self.strategy == "wait" and any(self.age(self.issued_at[f]) >= self.threshold for f in self.in_flight):
            return False                                    # stale groups still running: they train once done
        return super().ready()

    def _evict_stale(self) -> None:
        """`drop`: finished groups older than the threshold leave the queue; as many new prompts may be issued."""
        if self.strategy != "drop":
            return
        stale = [b for b in self.queue if self.age(b.meta["issued_at"]) > self.threshold]
        if not stale:
            return
        self.queue = deque(b for b in self.queue if self.age(b.meta["issued_at"]) <= self.threshold)
        for b in stale:
            self.ledger.trained.update(b.meta["indices"])     # done with: never trained, never issued again
            self.budget += len(b.meta["indices"])
            self.evicted += [self.age(b.meta["issued_at"])] * len(b.meta["indices"])

    def _arrive(self, batch: Batch) -> None:
        """A finished group joins the queue; with dynamic sampling one without signal is evicted instead and a fresh
        prompt may be issued in its place (verl V1's refill)."""
        if self.filter is not None:
            keep = filter_groups(batch["uid"], group_metric(batch, self.filter.metric))
            groups = keep.reshape(len(batch.meta["indices"]), self.n)[:, 0].tolist()
            evicted = [i for i, k in zip(batch.meta["indices"], groups) if not k]
            if evicted:
                self.ledger.trained.update(evicted)           # done with: never trained, never issued again
                self.budget += len(evicted)
                self.filtered += len(evicted)
                if 0 < self.most_filtered < self.filtered:
                    raise DynamicSamplingExhausted(
                        f"algorithm.filter_groups: {self.filtered} prompt groups had no reward variance (by "
                        f"{self.filter.metric}) while step {self.step} gathered {self.queued_prompts()} of its "
                        f"{self.step_prompts}: more than max_num_gen_batches x data.gen_batch_size = "
                        f"{self.most_filtered}, the most the synchronous loop generates for a step. The policy is "
                        "solving (or failing) nearly every prompt: raise max_num_gen_batches (0 = no limit), use "
                        "harder/easier data, or disable filter_groups.")
                if not any(groups):
                    return
                kept = batch.select(keep)
                kept.meta = {**batch.meta, "indices": [i for i, k in zip(batch.meta["indices"], groups) if k]}
                batch = kept
        self.queue.append(batch)

    def take(self) -> tuple[Batch, dict[str, float]]:
        """The step's groups: the `train_batch_size` finished ones issued earliest (verl V1's order)."""
        self.queue = deque(sorted(self.queue, key=lambda b: b.meta["first"]))
        batch, metrics = super().take()
        return batch, {**metrics, **self.off_policy_metrics(batch)}

    def off_policy_metrics(self, batch: Batch) -> dict[str, float]:
        """verl V1's: the weight versions each trained response spans, and how far its newest and its oldest token's
        weights lag behind the policy now trained (version `self.version`); the groups dropped as stale."""
        versions, mask = batch["rollout_versions"], batch["response_mask"].bool()
        newest = versions.masked_fill(~mask, -1).max(-1).values
        oldest = versions.masked_fill(~mask, 2**62).min(-1).values
        empty = ~mask.any(-1)                              # (no response token: its first version stands)
        newest, oldest = torch.where(empty, versions[:, 0], newest), torch.where(empty, versions[:, 0], oldest)
        out: dict[str, float] = {}
        for name, values in (("trajectory_spans", newest - oldest + 1), ("trajectory_staleness", self.version - newest),
                             ("trajectory_staleness_worst", self.version - oldest)):
            v = values.float()
            out.update({f"training/off_policy/{name}/mean": float(v.mean()),
                        f"training/off_policy/{name}/max": float(v.max()),
                        f"training/off_policy/{name}/min": float(v.min())})
        if self.evicted:
            ages = np.array(self.evicted, dtype=float)
            out.update({"training/off_policy/evicted_samples": len(ages),
                        "training/off_policy/evicted_samples_staleness/mean": float(ages.mean()),
                        "training/off_policy/evicted_samples_staleness/max": float(ages.max()),
                        "training/off_policy/evicted_samples_staleness/min": float(ages.min())})
            self.evicted = []
        if self.filter is not None:
            out["training/filter_groups/evicted_samples"], self.filtered = self.filtered, 0
        out["colocate_async/queue_size"] = self.queued_prompts()
        out["colocate_async/in_flight_prompts"] = sum(len(p) for _, p in self.in_flight.values())
        return out


def colocated_step(t: Trainer, d: ColocatedDriver) -> dict[str, float]:
    """One step (see the module docstring); returns its metrics (verl's names)."""
    return timed_step(t, lambda timer: _step(t, d, timer))


def _step(t: Trainer, d: ColocatedDriver, timer: Timer) -> dict[str, float]:
    start = time.perf_counter()
    d.step = t.global_step
    with timer("gen"):
        interrupted = d.gather()
    batch, metrics = d.take()
    metrics.update(d.step_metrics(batch), **{"colocate_async/interrupted": interrupted})
    if t.reward_model is not None:           # a learned reward model scores the step's groups, as the sync loop's
        with timer("reward"):
            scores, scored = score_batch(t, batch)
        batch.update(scores)
        metrics.update(scored)
    batch, learned = learn(t, batch, timer, old_from_rollout=t.cfg.algorithm.rollout_correction.bypass_mode)
    metrics.update(learned)
    with timer("update_weights"):                       # into the engines, for the samples continued next step
        d.version += 1
        d.syncs += 1
        t.worker.sync_stream_weights(d.version)
        d.renew_budget()
    return finish_metrics(t, batch, timer, metrics, time.perf_counter() - start)


def fit_colocated(t: Trainer) -> dict[str, float]:
    """Train until `t.total_steps` (see the module docstring), restarting the workers from the last checkpoint after
    a lost rank when `trainer.restart_on_worker_failure` allows (`lathe.loop.recover`)."""
    return run_with_restarts(t, _fit)


def _fit(t: Trainer, first: bool) -> dict[str, float]:
    d, tr = ColocatedDriver(t), t.cfg.trainer
    resumed = (t.resume_state or {}).get("colocate_async")
    if resumed is not None:
        d.load_state_dict(resumed)
    t.worker.sync_stream_weights(d.version)            # the engines' weights (the checkpoint's) are version d.version
    if first and t.val_dataset is not None and (tr.val_before_train or tr.val_only) and resumed is None:
        t.tracker.log(validate(t), step=t.global_step)
    if tr.val_only:
        return {}
    profiler, last = step_profiler(t), {}
    with Progress("train", t.total_steps, initial=t.global_step, every_s=None) as bar, \
            FreezeAfterWarmup(t.cluster.groups if t.cluster else []) as frozen:
        while t.global_step < t.total_steps:
            t.global_step += 1
            with profiler.step(t.global_step):
                last = colocated_step(t, d)
            done = t.global_step >= t.total_steps
            if tr.test_freq > 0 and t.val_dataset is not None and (t.global_step % tr.test_freq == 0 or done):
                last.update(validate(t))
            t.tracker.log(last, step=t.global_step)
            bar.update(t.global_step, brief(last))
            frozen.after_step(t.total_steps - t.global_step)
            if tr.save_freq > 0 and (t.global_step % tr.save_freq == 0 or done):
                save(t, extra={"colocate_async": d.state_dict()})
    return last
