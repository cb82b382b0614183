"""The driver's side of the worker groups: the same methods as `ActorRolloutRefWorker` and `CriticWorker`, each
split across the data-parallel ranks and joined back (`lathe.cluster.dispatch`), so `loop/ppo.py` drives one
device or a cluster with the same code. What each rank builds is `lathe.workers.build`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lathe.batch import Batch
from lathe.cluster.dispatch import contiguous_shares, even_shares, in_order, update_shares
from lathe.generation import SamplingParams
from lathe.rollout.base import concat_rollouts

ACTOR, CRITIC, SFT, REWARD_MODEL = "actor_rollout_ref", "critic", "sft", "reward_model"
SUMMED = ("rollout/num_preemptions", "rollout/graph_captures")


# -- on the driver -------------------------------------------------------------------------------------
def generate_over_ranks(group, role: str, prompts: Batch, params: SamplingParams, pad_id: int, *,
                        replica_size: int = 1) -> Batch:
    """`role.generate_sequences` over the group's engine replicas (consecutive blocks of `replica_size` ranks, each
    rank of a block given the same share), the prompts in consecutive shares; each sample is seeded by its place in
    the whole call, so the samples are those one undivided call draws; the replicas' metrics merged."""
    if params.seed is None and not params.greedy:
        params = replace(params, seed=int(torch.randint(0, 2**62, (1,))))
    shares = contiguous_shares(len(prompts), group.world_size // replica_size)
    calls = [((prompts.select(list(s)), params), {"first_index": s.start * params.n}) if len(s) else None
             for s in shares for _ in range(replica_size)]
    outs = [o for o in group.call_each(role, "generate_sequences", calls) if o is not None]
    batch = concat_rollouts(outs, pad_id)
    batch.meta["rollout_metrics"] = merge_rollout_metrics([o.meta.get("rollout_metrics", {}) for o in outs])
    return batch


class ActorRolloutRefGroup:
    """`ActorRolloutRefWorker`'s methods over a worker group: rollout split by prompts, log-probs by balanced
    equal shares, updates mini-batch by mini-batch (see `update_shares`); answers joined in batch order."""

    def __init__(self, group, *, pad_id: int, mini_batch_size: int, balance: bool, has_ref: bool,
                 rollout_tp: int = 1):
        self.group, self.pad_id, self.mini_batch_size, self.balance = group, pad_id, mini_batch_size, balance
        self.has_ref, self.rollout_tp = has_ref, rollout_tp
        self.world = group.world_size

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        return generate_over_ranks(self.group, ACTOR, prompts, params, self.pad_id, replica_size=self.rollout_tp)

    def compute_log_prob(self, batch: Batch) -> Batch:
        return self._forward("compute_log_prob", batch)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self._forward("compute_ref_log_prob", batch)

    def _forward(self, method: str, batch: Batch) -> Batch:
        shares = even_shares(batch, self.world, balance=self.balance)
        outs = self.group.call_each(ACTOR, method, [((batch.select(s),), {}) for s in shares])
        return in_order(outs, shares)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        shares = update_shares(batch, self.world, mini_batch_size=self.mini_batch_size, balance=self.balance)
        return self.group.call_each(ACTOR, "update_actor", [((batch.select(s),), {}) for s in shares])[0]

    def sync_weights(self) -> None:
        self.group.call(ACTOR, "sync_weights")

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
    """`CriticWorker`'s methods over the same ranks (colocated with the actor)."""

    def __init__(self, group, *, mini_batch_size: int, balance: bool):
        self.group, self.mini_batch_size, self.balance = group, mini_batch_size, balance
        self.world = group.world_size

    def compute_values(self, batch: Batch) -> Batch:
        shares = even_shares(batch, self.world, balance=self.balance)
        outs = self.group.call_each(CRITIC, "compute_values", [((batch.select(s),), {}) for s in shares])
        return in_order(outs, shares)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        shares = update_shares(batch, self.world, mini_batch_size=self.mini_batch_size, balance=self.balance)
        return self.group.call_each(CRITIC, "update_critic", [((batch.select(s),), {}) for s in shares])[0]

    def save_checkpoint(self, path: Path) -> None:
        self.group.call(CRITIC, "save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self.group.call(CRITIC, "load_checkpoint", Path(path))


class RewardModelGroup:
    """`RewardModelWorker`'s method over the same ranks (colocated with the actor): each rank scores an equal share."""

    def __init__(self, group, *, balance: bool):
        self.group, self.balance, self.world = group, balance, group.world_size

    def compute_rm_score(self, batch: Batch) -> Batch:
        shares = even_shares(batch, self.world, balance=self.balance)
        outs = self.group.call_each(REWARD_MODEL, "compute_rm_score", [((batch.select(s),), {}) for s in shares])
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


def merge_rollout_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' engine metrics as one step's: counts summed, seconds the slowest rank's, sizes rank 0's."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        out[key] = sum(values) if key in SUMMED else max(values) if key.startswith("timing_s/") else values[0]
    return out
