"""The driver's side of the worker groups: the same methods as `ActorRolloutRefWorker` and `CriticWorker`, each
split across the data-parallel ranks and joined back (`lathe.cluster.dispatch`), so `loop/ppo.py` drives one
device or a cluster with the same code. What each rank builds is `lathe.workers.build`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lathe.batch import Batch
from lathe.engine.speculative import SPEC_MEANS, SPEC_TOTALS, merge_spec_metrics
from lathe.cluster.dispatch import (contiguous_shares, even_shares, for_groups, in_order, one_per_group,
                                    select_share, update_shares)
from lathe.generation import SamplingParams
from lathe.rollout.base import concat_rollouts

ACTOR, CRITIC, SFT, REWARD_MODEL, TEACHER = "actor_rollout_ref", "critic", "sft", "reward_model", "teacher"
SUMMED = ("rollout/num_preemptions", "rollout/graph_captures", "rollout/prefill_tokens")


# -- on the driver -------------------------------------------------------------------------------------
def generate_over_ranks(group, role: str, prompts: Batch, params: SamplingParams, pad_id: int, *,
                        replica_size: int = 1, every_replica: bool = False) -> Batch:
    """`role.generate_sequences` over the group's engine replicas (consecutive blocks of `replica_size` ranks, each
    rank of a block given the same share), the prompts in consecutive shares; each sample is seeded by its place in
    the whole call, so the samples are those one undivided call draws; the replicas' metrics merged. A replica
    whose share is empty is not called, but with `every_replica` (data-parallel attention: the replicas of an engine
    run in lockstep, `lathe.engine.data_parallel`), which calls it with no prompts."""
    if params.seed is None and not params.greedy:
        params = replace(params, seed=int(torch.randint(0, 2**62, (1,))))
    shares = contiguous_shares(len(prompts), group.world_size // replica_size)
    calls = [((prompts.select(list(s)), params), {"first_index": s.start * params.n}) if len(s) or every_replica
             else None for s in shares]
    answers = group.call_each(role, "generate_sequences", for_groups(calls, replica_size))
    outs = [o for o in one_per_group(answers, replica_size) if o is not None]
    batch = concat_rollouts(outs, pad_id)
    batch.meta["rollout_metrics"] = merge_rollout_metrics([o.meta.get("rollout_metrics", {}) for o in outs])
    return batch


class ActorRolloutRefGroup:
    """`ActorRolloutRefWorker`'s methods over a worker group: rollout split by prompts, log-probs by balanced
    equal shares, updates mini-batch by mini-batch (see `update_shares`); answers joined in batch order. With
    Ulysses sequence or tensor parallelism (`actor_sp`: the actor's group size for its log-probs and update, `ref_sp`:
    the reference's), the shares are one per such group, given to each of its ranks (`lathe.cluster.dispatch.
    for_groups`). `teacher_group`: the teachers' own pool (`lathe.cluster.teacher_pool`), where the teachers' log-probs
    are computed instead of on the actor's ranks. `keep_groups` (`actor.use_prefix_grouper`): the actor's and the
    reference's passes deal each prompt's rows to one rank, so that its prompt runs once."""

    def __init__(self, group, *, pad_id: int, mini_batch_size: int, balance: bool, has_ref: bool,
                 rollout_tp: int = 1, actor_sp: int = 1, ref_sp: int = 1, has_teacher: bool = False,
                 teacher_group=None, rollout_lockstep: bool = False, keep_groups: bool = False):
        self.group, self.pad_id, self.mini_batch_size, self.balance = group, pad_id, mini_batch_size, balance
        self.keep_groups = keep_groups
        self.has_ref, self.rollout_tp, self.actor_sp, self.ref_sp = has_ref, rollout_tp, actor_sp, ref_sp
        self.has_teacher, self.teacher_group = has_teacher, teacher_group
        self.rollout_lockstep = rollout_lockstep      # data-parallel attention: every replica called, even idle
        self.world = group.world_size

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        return generate_over_ranks(self.group, ACTOR, prompts, params, self.pad_id, replica_size=self.rollout_tp,
                                   every_replica=self.rollout_lockstep)

    def compute_log_prob(self, batch: Batch) -> Batch:
        return forward_over_groups(self.group, ACTOR, "compute_log_prob", batch, self.actor_sp, self.balance,
                                   self.keep_groups)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return forward_over_groups(self.group, ACTOR, "compute_ref_log_prob", batch, self.ref_sp, self.balance,
                                   self.keep_groups)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """The teachers on every rank of their own pool, or colocated on every rank of the actor's, each rank given its
        own share (teachers have no sequence parallelism)."""
        if self.teacher_group is not None:
            return forward_over_groups(self.teacher_group, TEACHER, "compute_teacher_log_prob", batch, 1,
                                       self.balance)
        return forward_over_groups(self.group, ACTOR, "compute_teacher_log_prob", batch, 1, self.balance)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return update_over_groups(self.group, ACTOR, "update_actor", batch, self.actor_sp, self.mini_batch_size,
                                  self.balance, self.keep_groups)

    def sync_weights(self) -> None:
        self.group.call(ACTOR, "sync_weights")

    # colocate_async (`lathe.loop.colocate_async`): each engine replica streams its own requests, every rank of a
    # tensor-parallel replica the same ones for the same engine steps (their schedulers agree), its first answering
    def stream_run_each(self, per_replica: list[list[tuple]], max_steps: int) -> list[dict]:
        calls = for_groups([((r, max_steps), {}) for r in per_replica], self.rollout_tp)
        return one_per_group(self.group.call_each(ACTOR, "stream_run", calls), self.rollout_tp)

    def stream_pause(self) -> int:
        return sum(one_per_group(self.group.call(ACTOR, "stream_pause"), self.rollout_tp))

    def sync_stream_weights(self, version: int) -> None:
        self.group.call(ACTOR, "sync_stream_weights", version)

    def save_checkpoint(self, path: Path) -> None:
        self.group.call(ACTOR, "save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self.group.call(ACTOR, "load_checkpoint", Path(path))


class AsyncActorGroup(ActorRolloutRefGroup):
    """Fully-async training's trainer ranks: the actor's methods, with generation going to the rollout replicas
    (validation) and no colocated engine to sync (the driver broadcasts the weights: `AsyncCluster.sync`)."""

    def __init__(self, group, replicas, **kwargs):
        super().__init__(group, **kwargs)
        self.replicas = replicas

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.replicas.generate_sequences(prompts, params)

    def sync_weights(self) -> None:
        pass


class CriticGroup:
    """`CriticWorker`'s methods over the same ranks (colocated with the actor); `sp`: the critic's Ulysses size."""

    def __init__(self, group, *, mini_batch_size: int, balance: bool, sp: int = 1):
        self.group, self.mini_batch_size, self.balance, self.sp = group, mini_batch_size, balance, sp
        self.world = group.world_size

    def compute_values(self, batch: Batch) -> Batch:
        return forward_over_groups(self.group, CRITIC, "compute_values", batch, self.sp, self.balance)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return update_over_groups(self.group, CRITIC, "update_critic", batch, self.sp, self.mini_batch_size,
                                  self.balance)

    def save_checkpoint(self, path: Path) -> None:
        self.group.call(CRITIC, "save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self.group.call(CRITIC, "load_checkpoint", Path(path))


class RewardModelGroup:
    """`RewardModelWorker`'s method over the same ranks (colocated with the actor): each rank scores an equal share."""

    def __init__(self, group, *, balance: bool):
        self.group, self.balance, self.world = group, balance, group.world_size

    def compute_rm_score(self, batch: Batch) -> Batch:
        shares = even_shares(batch, self.world, balance=self.balance, ghosts=True)
        outs = self.group.call_each(REWARD_MODEL, "compute_rm_score", [((select_share(batch, s),), {})
                                                                       for s in shares])
        return in_order(outs, shares)


class SFTGroup:
    """`SFTWorker`'s methods over a worker group: each batch dealt to the ranks in equal shares (balanced by tokens
    with `balance`); the ranks' loss is already normalised by the whole batch's trained tokens."""

    def __init__(self, group, *, balance: bool):
        self.group, self.balance, self.world = group, balance, group.world_size

    def _each(self, method: str, batch: Batch):
        shares = even_shares(batch, self.world, balance=self.balance)
        return self.group.call_each(SFT, method, [((batch.select(s),), {}) for s in shares])[0]

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self._each("train_step", batch)

    def eval_loss(self, batch: Batch) -> dict[str, float]:
        return self._each("eval_loss", batch)

    def save_checkpoint(self, path: Path) -> None:
        self.group.call(SFT, "save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self.group.call(SFT, "load_checkpoint", Path(path))


def forward_over_groups(group, role: str, method: str, batch: Batch, sp: int, balance: bool,
                        keep_groups: bool = False) -> Batch:
    """`role.method` over balanced equal shares (ghost rows padding them where the rows do not divide: `lathe.cluster.
    dispatch`), one per data-parallel group of `sp` ranks; answers in batch order. `keep_groups`: a prompt's rows dealt
    to one rank (the actor's prefix-grouped forward)."""
    shares = even_shares(batch, group.world_size // sp, balance=balance, ghosts=True, keep_groups=keep_groups)
    outs = group.call_each(role, method, for_groups([((select_share(batch, s),), {}) for s in shares], sp))
    return in_order(one_per_group(outs, sp), shares)


def update_over_groups(group, role: str, method: str, batch: Batch, sp: int, mini_batch_size: int,
                       balance: bool, keep_groups: bool = False) -> dict[str, float]:
    """`role.method` (an update) over `update_shares`, one per data-parallel group of `sp` ranks; rank 0's metrics
    (already summed over the ranks)."""
    shares = update_shares(batch, group.world_size // sp, mini_batch_size=mini_batch_size, balance=balance,
                           ghosts=True, keep_groups=keep_groups)
    return group.call_each(role, method, for_groups([((select_share(batch, s),), {}) for s in shares], sp))[0]


def merge_rollout_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The replicas' engine metrics as one step's: counts summed, seconds the slowest replica's, sizes the first's,
    speculative decoding's acceptance merged (`merge_spec_metrics`)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        if key in SPEC_TOTALS or key in SPEC_MEANS:
            continue
        values = [p[key] for p in parts if key in p]
        out[key] = sum(values) if key in SUMMED else max(values) if key.startswith("timing_s/") else values[0]
    for p in parts:                 # speculative decoding's acceptance (`lathe.engine.speculative`)
        merge_spec_metrics(out, p)
    return out
