"""Fully asynchronous training (verl's fully_async_policy): the Rollouter and the Trainer on separate device pools.

The driver keeps both pools busy at once:

    rollout pool:  prompts --submit--> replicas generate continuously --collect--> score --> queue of groups
    trainer pool:  queue --(require_batches x ppo_mini_batch_size prompts)--> learn (one local update)
    every trigger_parameter_sync_step updates: pause the replicas (partial rollout: interrupt; else let them
    finish), broadcast the weights trainer -> replicas in buckets, resume

Staleness (verl's semantics): between two syncs the Rollouter starts at most
`(1 + staleness_threshold) x trigger_parameter_sync_step x require_batches x ppo_mini_batch_size` prompts, less
those still queued or running when the interval began. `staleness_threshold=0` with `trigger_parameter_sync_step=1`
is on-policy (the synchronous loop on two pools: same samples, same updates); `staleness_threshold=1` with one update
per sync is verl's one-step-off policy. Every sample carries the weight version(s) it was sampled with; a trained
batch reports its lag behind the trainer's version.

DAPO's dynamic sampling filters each request's groups as it arrives and asks for more rounds for a step short of
kept prompts (`lathe.loop.fully_async_dapo`); ReMax sends each request with a greedy twin whose reward is the
baseline; with LoRA the sync sends only the adapted layers, merged (`AsyncTrainerWorker`); multi-turn requests
carry their rows' tool kwargs and messages, and the replica runs their trajectories (`lathe.rollout.agent.stream`).

A learned reward model (`reward_model.enable`, the sequence-classification model) lives on the trainer pool's ranks,
colocated with the actor, or with `reward_model.enable_resource_pool` on a pool of its own beside the other two, as in
the synchronous loop: the driver leaves the requests unscored and the trainer thread scores each training batch with
it just before the update (`lathe.loop.fully_async_learn`, through `score_batch`, so the scores are the synchronous
loop's). The distillation teachers likewise: on the trainer's ranks, or on their own pool (`distillation.nnodes`).
What reads scores on the driver before that (dynamic sampling's filter, ReMax's greedy baseline) is refused with a
reward model at config load (`lathe.config.support`). A generative judge
(`reward_model.judge`) scores the same way, its engine on the trainer's ranks.

Every prompt gets an issue index when it is sent; its samples are seeded by it exactly as the synchronous loop
seeds the same prompt of the same step, and a checkpoint records which issued prompts were trained, so a resumed run
re-issues the untrained ones (none lost, none trained twice).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from lathe.batch import Batch
from lathe.rollout.agent import check_agent_names
from lathe.cluster.roles import ACTOR
from lathe.rollout.agent.custom import custom_loops_in
from lathe.workers.fully_async import agent_rollout, request_agent, request_images
from lathe.loop.fully_async_dapo import DynamicSampling
from lathe.loop.fully_async_learn import learn_batch
from lathe.loop.ppo import save
from lathe.loop.recover import run_with_restarts
from lathe.engine.speculative import SPEC_MEANS, SPEC_TOTALS, merge_spec_metrics
from lathe.loop.sampling import SUMMED_ROLLOUT_METRICS, rollout_seed
from lathe.loop.setup import Trainer, prompt_batch
from lathe.loop.steps import compute_reward, reward_extra_means
from lathe.loop.validate import validate
from lathe.rollout.base import concat_rollouts
from lathe.track import Progress, brief

log = logging.getLogger("lathe")
COUNTED = (*SUMMED_ROLLOUT_METRICS, "rollout/num_interrupted", "reward/num_errors", "reward/num_timeouts")


@dataclass
class Ledger:
    """Which prompts were issued and trained (what a checkpoint must know to resume exactly)."""

    issued: int = 0                                   # issue index of the next prompt
    chunk_states: dict[int, dict] = field(default_factory=dict)   # first index of a chunk -> loader state before it
    trained: set[int] = field(default_factory=set)    # trained issue indices at or after the oldest untrained chunk
    skip: set[int] = field(default_factory=set)       # on resume: issued before and trained already

    def untrained_from(self, pending: set[int]) -> int:
        return min(pending) if pending else self.issued

    def forget_before(self, oldest: int) -> None:
        """Drop what no resume point can need any more: everything before the oldest untrained prompt's chunk."""
        keep = max((c for c in self.chunk_states if c <= oldest), default=oldest)
        self.chunk_states = {c: s for c, s in self.chunk_states.items() if c >= keep}
        self.trained = {i for i in self.trained if i >= keep}

    def state_dict(self, pending: set[int], loader_state: dict) -> dict:
        """Resume point: the oldest chunk that holds an untrained prompt (its loader state), and the prompts after it
        that were trained already."""
        first = self.untrained_from(pending)
        chunk = max((c for c in self.chunk_states if c <= first), default=None)
        if chunk is None or not pending:
            return {"issued": self.issued, "loader": loader_state, "trained": []}
        return {"issued": chunk, "loader": self.chunk_states[chunk], "trained": sorted(i for i in self.trained
                                                                                      if i >= chunk)}


@dataclass(frozen=True)
class Pace:
    """How the driver issues prompts: a training step's prompts, the prompts of a sync interval, the staleness
    bound (the interval starts at most `(1 + staleness) x per_sync` prompts, less those still queued or running),
    prompts per request, and the prompts it issues in all."""

    step_prompts: int
    per_sync: int
    staleness: float
    chunk: int
    total_prompts: float

    @staticmethod
    def fully_async(t: Trainer) -> Pace:
        """verl's fully_async_policy: a step is require_batches x ppo_mini_batch_size prompts (config/fill.py), a
        sync every trigger_parameter_sync_step steps, requests of data.gen_batch_size prompts."""
        cfg, at = t.cfg, t.cfg.async_training
        step = t.plan.actor.prompts_per_step
        # (dynamic sampling needs more prompts than it trains: as many as its dropped groups, each step at most
        # `max_num_gen_batches` rounds)
        total = cfg.rollout.total_rollout_steps or (
            math.inf if cfg.algorithm.filter_groups.enable else t.total_steps * step)
        return Pace(step, at.trigger_parameter_sync_step * step, at.staleness_threshold, cfg.data.gen_batch_size,
                    total)


class AsyncDriver:
    """The single controller of the two pools (see the module docstring). `rollout`: the replicas' handle
    (`RolloutGroup`'s methods; the rollout pool's by default), `pace`: how prompts are issued (`Pace.fully_async`
    by default); `lathe.loop.colocate_async` drives the trainer's own engines with both of its own."""

    def __init__(self, t: Trainer, rollout=None, pace: Pace | None = None):
        cfg, self.t = t.cfg, t
        self.at, self.cluster = cfg.async_training, t.cluster
        self.rollout = rollout if rollout is not None else t.cluster.rollout
        self.pace = pace or Pace.fully_async(t)
        self.step_prompts, self.per_sync = self.pace.step_prompts, self.pace.per_sync
        self.n, self.chunk, self.total_prompts = t.sampling.n, self.pace.chunk, self.pace.total_prompts
        self.version, self.syncs, self.updates_since_sync = 0, 0, 0
        self.ledger = Ledger()
        self.rows: list[dict] = []      # drawn from the loader, not yet issued (requests smaller than its batches)
        self.in_flight: dict[int, tuple[int, Batch]] = {}        # first issue index -> (replica, prompt rows)
        self.issued_at: dict[int, int] = {}     # first issue index -> `self.step` when it was sent
        self.step = t.global_step + 1   # the step whose rollout sends prompts now (colocate_async advances it;
                                        # fully-async leaves it: its batches' `issued_at` go unread)
        self.queue: deque[Batch] = deque()                        # scored groups, in the order they finished
        self.budget = self._budget(stale=0)
        self.load = [0] * self.rollout.world    # each replica's tokens in flight (`least_loaded`)
        self.busy = [0.0] * self.rollout.world
        self.counters = dict.fromkeys(("stale_samples", "stale_trajectories"), 0)
        self.counted: dict[str, float] = {}               # request metrics since the last trained step
        fg = cfg.algorithm.filter_groups                  # DAPO's dynamic sampling: lathe.loop.fully_async_dapo
        self.dapo = (DynamicSampling(fg, step_prompts=self.step_prompts, n=self.n, first_step=t.global_step + 1)
                     if fg.enable else None)
        self.remax = cfg.algorithm.adv_estimator == "remax"   # each request's greedy twin, its reward the baseline
        # requests carry tools' kwargs and messages (the tool loop), the rows' fields too (custom agent loops)
        self.multi_turn, self.custom_loops = agent_rollout(cfg.actor_rollout_ref.rollout), custom_loops_in(
            cfg.actor_rollout_ref.rollout)
        self.arrived: dict[int, dict[str, Batch]] = {}    # first issue index -> what came of its requests so far
        self.full_bytes: int | None = None

    # -- the Rollouter's side ------------------------------------------------------------------------------
    def _budget(self, stale: int) -> int:
        return max(0, math.floor((1 + self.pace.staleness) * self.per_sync) - stale)

    def _can_send(self) -> bool:
        return self.budget > 0 if self.dapo else self.budget >= self.chunk

    def held_back(self) -> bool:
        """Prompts are left to issue but the interval's budget (the staleness bound) lets the Rollouter start none."""
        return self.ledger.issued < self.total_prompts and not self._can_send()

    def fill(self) -> None:
        """Send chunks of prompts to the replicas (each to the least loaded) while the interval's budget lasts."""
        requests: dict[int, list] = {}
        while self.ledger.issued < self.total_prompts and self._can_send():
            label = self.dapo.label() if self.dapo else None      # (step, round) of a dynamic-sampling round
            first = self.ledger.issued
            rows = self._next_rows()
            self.ledger.issued += len(rows)
            if all(first + i in self.ledger.skip for i in range(len(rows))):
                continue                                                   # trained before the resume
            self.budget -= len(rows)
            if self.dapo:
                self.dapo.issued(first, label, len(rows))
            prompts = prompt_batch(rows, step=0)
            prompts = Batch(non_tensors={**prompts.non_tensors, "uid": [f"p{first + i}" for i in range(len(rows))]})
            check_agent_names(prompts, self.t.cfg.actor_rollout_ref.rollout)       # (rows naming verl's loops)
            # seeded as the synchronous loop seeds prompt i of its step s (same samples when on-policy); a dynamic-
            # sampling round as it seeds round r of step s
            step, i = divmod(first, self.step_prompts)
            step, round_, i = (*label, 0) if label else (step + 1, 0, i)
            params = replace(self.t.sampling, seed=self.t.sampling.seed if self.t.sampling.seed is not None
                             else rollout_seed(self.t.cfg.trainer.seed, step, round_))
            ids, images = [list(p) for p in prompts["prompt_ids"]], request_images(prompts)
            replica = self.least_loaded()
            self.in_flight[first], self.issued_at[first] = (replica, prompts), self.step
            self.load[replica] += self.tokens(ids)
            agent = request_agent(prompts, self.custom_loops) if self.multi_turn else None
            requests.setdefault(replica, []).append((first, ids, params, i * self.n, images, agent))
            if self.remax:        # ReMax's greedy response of each prompt, generated beside (and with) the samples
                requests[replica].append((("greedy", first), ids, replace(params, n=1, do_sample=False), 0, images,
                                          agent))
        if requests:
            self.rollout.submit(requests)

    def _next_rows(self) -> list[dict]:
        """The next request's rows: `chunk` of them, drawn from the loader's batches (whose state before each is kept
        for a resume, keyed by the issue index of its first row)."""
        while len(self.rows) < self.chunk:
            self.ledger.chunk_states[self.ledger.issued + len(self.rows)] = self.t.loader.state_dict()
            self.rows += self.t.next_rows()
        rows, self.rows = self.rows[:self.chunk], self.rows[self.chunk:]
        return rows

    def least_loaded(self) -> int:
        """The replica with the fewest tokens in flight, the first among equals: balanced by tokens, not by prompts,
        so a replica whose requests finished early (short responses) takes the next chunks, which round robin would
        queue behind a replica still busy with long ones."""
        return min(range(len(self.load)), key=self.load.__getitem__)

    def tokens(self, ids: list[list[int]]) -> int:
        """What a chunk of prompts asks of a replica, in tokens: n samples of each prompt with the whole response
        budget (ReMax adds one greedy sample per prompt)."""
        samples = self.n + self.remax
        return sum(samples * (len(p) + self.t.sampling.max_tokens) for p in ids)

    def poll(self, wait_s: float) -> int:
        """Finished requests from the replicas: scored and queued. Returns how many came."""
        done, busy = self.rollout.collect(wait_s)
        self.busy = busy
        finished = 0
        for request_id, gen in done:
            kind, first = request_id if isinstance(request_id, tuple) else ("samples", request_id)
            parts = self.arrived.setdefault(first, {})
            parts[kind] = gen
            if self.remax and len(parts) < 2:
                continue                                  # the samples wait for their greedy twin, or it for them
            del self.arrived[first]
            finished += 1
            self._score(first, parts)
        return finished

    def _score(self, first: int, parts: dict[str, Batch]) -> None:
        """A finished request's groups scored (ReMax: with their greedy baselines), filtered (dynamic sampling) and
        queued. With a reward model they are queued unscored: the trainer thread scores them (`fully_async_learn.learn_batch`)."""
        replica, prompts = self.in_flight.pop(first)
        self.load[replica] -= self.tokens(prompts["prompt_ids"])
        batch = prompts.repeat(self.n, interleave=True).update(parts["samples"])
        metrics: dict[str, float] = {}
        if self.t.reward_model is None:
            scores, metrics = compute_reward(batch, self.t.tokenizer, self.t.reward,
                                             overlong=self.t.cfg.reward_model.overlong_buffer,
                                             max_response_length=self.t.cfg.data.max_response_length)
            batch.update(scores)
        if "greedy" in parts:                 # as `lathe.loop.sampling.greedy_baseline` scores it
            greedy = prompts.repeat(1).update(parts["greedy"])
            greedy_scores, _ = compute_reward(greedy, self.t.tokenizer, self.t.reward)
            batch["reward_baselines"] = greedy_scores["seq_scores"].repeat_interleave(self.n)
        rollout_metrics = batch.meta.pop("rollout_metrics", {})
        merge_spec_metrics(self.counted, rollout_metrics)     # speculative decoding's acceptance, over the step
        for key, value in {**metrics, **rollout_metrics}.items():
            if key in SPEC_TOTALS or key in SPEC_MEANS:
                continue
            if key in COUNTED:                        # per request: summed over the step
                self.counted[key] = self.counted.get(key, 0) + value
            elif not key.startswith("reward_extra/"):    # (those are over the trained batch: step_metrics)
                self.counted[key] = value
        batch.meta.update(first=first, indices=list(range(first, first + len(prompts))),
                          issued_at=self.issued_at.pop(first))
        self._arrive(batch)

    def _arrive(self, batch: Batch) -> None:
        """A scored request's groups join the queue (dynamic sampling: its round's kept groups wait for their step)."""
        if self.dapo:
            never = self.dapo.arrived(batch.meta["first"], batch)     # dropped groups: their prompts are done with
            self.ledger.trained.update(never)
            self.budget += len(never)
        else:
            self.queue.append(batch)

    def check_waiting(self, since: float) -> None:
        """The trainer waits for prompts: fail, saying why, when none can come or none came for the timeout."""
        queued, waited = self.queued_prompts(), time.monotonic() - since
        if not self.in_flight and self.ledger.issued >= self.total_prompts:
            raise RuntimeError(f"fully async: a step needs {self.step_prompts} finished prompts, {queued} are queued "
                               f"and the rollout has issued all {self.total_prompts} (rollout.total_rollout_steps / "
                               "the data): nothing more can come")
        if waited > self.t.cfg.actor_rollout_ref.nccl_timeout:
            by_replica: dict[int, int] = {}
            for replica, prompts in self.in_flight.values():
                by_replica[replica] = by_replica.get(replica, 0) + len(prompts)
            raise TimeoutError(f"fully async: no rollout request finished in {waited:.0f} s "
                               f"(actor_rollout_ref.nccl_timeout) while the trainer waited for {self.step_prompts} "
                               f"prompts ({queued} queued); prompts in flight by replica: {by_replica}")

    def step_metrics(self, batch: Batch) -> dict[str, float]:
        """What the rollout side reports for a trained step: the requests' counts since the last step, and the
        scorer extras of the trained samples."""
        out, self.counted = self.counted, {}
        return {**out, **reward_extra_means(batch["reward_extra_info"] if "reward_extra_info" in batch else [])}

    def queued_prompts(self) -> int:
        """Finished prompts waiting to be trained (kept ones, with dynamic sampling)."""
        return self.dapo.queued_prompts() if self.dapo else sum(len(b) for b in self.queue) // self.n

    def ready(self) -> bool:
        """A training step's prompts have finished (dynamic sampling: its rounds' kept groups fill it)."""
        return self.dapo.ready() if self.dapo else self.queued_prompts() >= self.step_prompts

    def take(self) -> tuple[Batch, dict[str, float]]:
        """The next training batch, `step_prompts` prompts ordered by issue index (the oldest finished groups, or
        the next step's kept groups with dynamic sampling), and the metrics of how it was gathered."""
        metrics: dict[str, float] = {}
        if self.dapo:
            batch, never, metrics = self.dapo.take(self.t.tokenizer.pad_token_id)
            self.ledger.trained.update(never)             # kept groups beyond the step: done with, as dropped ones
            self.budget += len(never)
            trained = batch.meta["indices"]
        else:
            groups, have = [], 0
            while have < self.step_prompts:
                groups.append(self.queue.popleft())
                have += len(groups[-1]) // self.n
            groups.sort(key=lambda b: b.meta["first"])
            trained = [i for b in groups for i in b.meta["indices"]]
            batch = concat_rollouts(groups, self.t.tokenizer.pad_token_id)
        self.ledger.trained.update(trained)
        self.ledger.forget_before(min(self.pending(), default=self.ledger.issued))
        return batch, metrics

    def pending(self) -> set[int]:
        """Issued prompts not yet trained (nor dropped): running, or finished and waiting."""
        out = {i for first, (_, p) in self.in_flight.items() for i in range(first, first + len(p))}
        return out | (self.dapo.pending() if self.dapo else {i for b in self.queue for i in b.meta["indices"]})

    def staleness_metrics(self, batch: Batch) -> dict[str, float]:
        """How far the trained responses lag behind the rollout's weights (in syncs, from each response's first
        token), the stale prompts (any response begun before the last sync; verl's 'samples') and responses so far,
        and the responses that mix weight versions (partial rollouts)."""
        versions, mask = batch["rollout_versions"], batch["response_mask"].bool()
        first = versions[:, 0]
        last = torch.where(mask.any(-1), versions.masked_fill(~mask, -1).max(-1).values, first)
        lag = (self.version - first).float()
        stale = (lag > 0).tolist()
        self.counters["stale_trajectories"] += sum(stale)
        self.counters["stale_samples"] += len({uid for uid, s in zip(batch["uid"], stale) if s})
        partial = last != first
        return {"fully_async/staleness/mean": float(lag.mean()), "fully_async/staleness/max": float(lag.max()),
                "fully_async/count/stale_samples_processed": self.counters["stale_samples"],
                "fully_async/count/stale_trajectory_processed": self.counters["stale_trajectories"],
                "fully_async/partial/total_partial_num": int(partial.sum()),
                "fully_async/partial/partial_ratio": float(partial.float().mean()),
                "fully_async/partial/max_partial_span": float((last - first).max()),
                "fully_async/queue_size": self.queued_prompts(), "fully_async/policy_version": self.version}

    # -- the weight sync ----------------------------------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Pause the replicas, broadcast the trainer's weights, resume; a new interval's budget."""
        start = time.perf_counter()
        interrupted = self.rollout.pause(partial=self.at.partial_rollout)
        self.poll(0.0)                                     # what finished while pausing
        stats = self.cluster.sync(self.version + 1)
        if self.full_bytes is None:              # what a sync of every weight would send (LoRA sends less)
            self.full_bytes = self.cluster.trainer_group.call(ACTOR, "full_weight_bytes")[0]
        self.version += 1
        self.syncs += 1
        self.rollout.resume()
        self.renew_budget()
        seconds = time.perf_counter() - start
        return {"timing_s/param_sync": seconds, "fully_async/sync/interrupted": interrupted,
                "fully_async/sync/gb": stats.get("bytes", 0) / 2**30,   # sent by the trainer's rank 0, all groups
                "fully_async/sync/gb_per_rollout_rank": stats.get("rank_bytes", stats.get("bytes", 0)) / 2**30,
                "fully_async/sync/fraction_of_full": stats.get("bytes", 0) / max(1, self.full_bytes),
                "fully_async/sync/send_s": stats.get("seconds", 0.0)}

    def renew_budget(self) -> None:
        """A new sync interval's budget: the staleness bound less the prompts still queued or running."""
        self.budget = self._budget(stale=self.queued_prompts() + sum(len(p) for _, p in self.in_flight.values()))

    def state_dict(self) -> dict:
        # rows drawn from the loader and not yet issued resume from their batch's state, as untrained prompts do
        pending = self.pending() | ({self.ledger.issued} if self.rows else set())
        return {**self.ledger.state_dict(pending, self.t.loader.state_dict()), "version": self.version,
                "syncs": self.syncs, "updates_since_sync": self.updates_since_sync, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint; the replicas then take its weights: the same version when it was saved right
        after a sync, else a new one (the trainer had updated since)."""
        self.version, self.syncs = state["version"], state["syncs"]
        self.version += bool(state["updates_since_sync"])
        self.counters.update(state["counters"])               # verl's stale counts run on across a resume
        self.ledger.issued = state["issued"]
        self.ledger.skip = set(state["trained"])
        self.t.loader.load_state_dict(state["loader"])


def fit_async(t: Trainer) -> dict[str, float]:
    """Train until `t.total_steps` local updates (see the module docstring), restarting both pools from the last
    checkpoint after a lost rank when `trainer.restart_on_worker_failure` allows (`lathe.loop.recover`: the driver
    continues from the checkpoint's state, so each prompt is still trained once)."""
    return run_with_restarts(t, _fit_async)


def _fit_async(t: Trainer, first: bool) -> dict[str, float]:
    d, tr = AsyncDriver(t), t.cfg.trainer
    resumed = (t.resume_state or {}).get("fully_async")
    if resumed is not None:
        d.load_state_dict(resumed)
    if resumed is not None or t.cfg.actor_rollout_ref.model.lora_adapter_path:
        t.cluster.rollout.pause(partial=True)             # the replicas start from the checkpoint's weights (or
        t.cluster.sync(d.version)                         # the given adapters merged: they load the base model)
        t.cluster.rollout.resume()
    if t.val_dataset is not None and (tr.val_before_train or tr.val_only) and resumed is None:
        t.tracker.log(validate(t), step=t.global_step)
    if tr.val_only:
        return {}
    bar = Progress("train", t.total_steps, initial=t.global_step, every_s=None)    # a terminal's live line
    pool = ThreadPoolExecutor(1, thread_name_prefix="lathe-trainer")
    training: Future | None = None
    last: dict[str, float] = {}
    wall = time.perf_counter()
    idle_since, idle = time.perf_counter(), 0.0
    held, hinted = 0.0, False                        # the trainer's wait while the staleness bound held prompts back
    first_step = t.global_step + 1
    progress_at = time.monotonic()                    # the last finished request (or a step in training)
    busy_at = (wall, list(d.busy))
    try:
        while t.global_step < t.total_steps or training is not None:
            d.fill()
            # the wait is the poll's: timed while the trainer is idle and the budget lets the Rollouter start nothing
            held_at = time.perf_counter() if training is None and d.held_back() else None
            if d.poll(wait_s=0.0 if training is not None and training[0].done() else 0.05) or training is not None:
                progress_at = time.monotonic()
            elif not d.ready():
                d.check_waiting(since=progress_at)
            if held_at is not None:
                held += time.perf_counter() - held_at
            if training is None and t.global_step < t.total_steps and d.ready():
                idle += time.perf_counter() - idle_since
                batch, gathered = d.take()
                current = d.version if d.updates_since_sync == 0 else None   # the trainer holds the rollout's weights
                t.global_step += 1                        # the step in training, counted as the synchronous loop does
                training = (pool.submit(learn_batch, t, batch, current),
                            {**d.staleness_metrics(batch), **d.step_metrics(batch), **gathered})
            if training is not None and training[0].done():
                last = {**training[1], **training[0].result()}
                training, idle_since = None, time.perf_counter()
                done = t.global_step >= t.total_steps
                d.updates_since_sync += 1
                if d.updates_since_sync == d.at.trigger_parameter_sync_step or done:
                    d.updates_since_sync = 0
                    last.update(d.sync_weights())
                    freq = t.cfg.rollout.test_freq                # verl's: every `test_freq` syncs
                    if freq > 0 and t.val_dataset is not None and d.syncs % freq == 0:
                        last.update(validate(t))
                if (tr.test_freq > 0 and t.val_dataset is not None and (t.global_step % tr.test_freq == 0 or done)
                        and not any(k.startswith("val") for k in last)):
                    last.update(validate(t))
                now = time.perf_counter()
                last["perf/time_per_step"] = now - wall         # wall time per update (`timing_s/step`: the update)
                last["perf/throughput"] = last["perf/total_num_tokens"] / max(now - wall, 1e-9)
                last["trainer/idle_ratio"] = idle / max(1e-9, now - wall)
                last["trainer/idle_staleness_ratio"] = min(held, idle) / max(1e-9, now - wall)
                last["rollouter/idle_ratio"] = 1 - _busy_fraction(busy_at, now, d.busy)
                if (not hinted and t.global_step >= first_step + 2 and d.at.staleness_threshold > 0  # (0: chosen)
                        and last["trainer/idle_staleness_ratio"] >= HINT_RATIO):
                    hinted = True
                    log.warning(staleness_hint(last["trainer/idle_staleness_ratio"], t.global_step,
                                               d.at.staleness_threshold))
                busy_at, wall, idle, held = (now, list(d.busy)), now, 0.0, 0.0
                t.tracker.log(last, step=t.global_step)
                bar.update(t.global_step, brief(last))
                if tr.save_freq > 0 and (t.global_step % tr.save_freq == 0 or done):
                    save(t, extra={"fully_async": d.state_dict()})
                progress_at = time.monotonic()             # (a sync, validation or save is no wait for prompts)
    finally:
        if training is not None:
            training[0].cancel()
        pool.shutdown(wait=True)
        bar.close()
    return last


HINT_RATIO = 0.25        # a step's share of waiting on the staleness bound that earns the one hint of a run


def staleness_hint(ratio: float, step: int, threshold: float) -> str:
    """The one-time hint of a run whose trainer waited on the staleness bound (`trainer/idle_staleness_ratio`)."""
    return (f"fully async: at step {step} the trainer waited {ratio:.0%} of the step for samples while the staleness "
            f"bound let the Rollouter start no more prompts (async_training.staleness_threshold={threshold:g}; "
            "prompts still running at a sync count against the next interval's budget, so a long tail of responses "
            "holds it). A higher staleness_threshold lets the Rollouter start further ahead, at the price of older "
            "samples (docs/fully_async.md: a cap-4096 0.5B long tail ran 1.36x the synchronous loop at 1 and 2.17x "
            "at 2). The metric trainer/idle_staleness_ratio tracks it each step.")


def _busy_fraction(since: tuple[float, list[float]], now: float, busy: list[float]) -> float:
    """The replicas' mean fraction of time spent stepping since `since`."""
    then, before = since
    span = max(1e-9, now - then)
    return min(1.0, sum(b - a for a, b in zip(before, busy)) / (span * max(1, len(busy))))


