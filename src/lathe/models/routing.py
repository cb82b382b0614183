"""Routing replay's trainer side: make a model's MoE layers route as given, or record how they route.

verl's `actor.router_replay.mode`: R3 replays the rollout engine's choices in the trainer's forwards; R2 records the
old-log-prob forward's and replays them in the update's. Choices are (T, layers, k) per forward, in its token order
(`lathe.models.moe.replay_route` for the weights)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lathe.models.moe import replay_route, route, sparse_blocks


class ReplayStats:
    """How often replay overrode the router: (token, layer) pairs given a choice, and those among them whose given
    experts are not the router's own top-k, summed over the forwards (device tensors: no host sync)."""

    def __init__(self):
        self.changed = self.given = 0

    @torch.no_grad()
    def add(self, probs: torch.Tensor, chosen: torch.Tensor, given: torch.Tensor, own=None) -> None:
        valid = (given >= 0).all(-1).to(probs.device)
        own = (own(probs)[1] if own is not None else torch.topk(probs, chosen.shape[-1], dim=-1).indices
               ).sort(-1).values
        changed = (own != chosen.sort(-1).values).any(-1) & valid
        self.changed, self.given = self.changed + changed.sum(), self.given + valid.sum()


class _Replay:
    def __init__(self, given: torch.Tensor, stats: ReplayStats | None):
        self.given, self.stats = given, stats

    def __call__(self, probs, top_k, norm_topk_prob, own=None, weigh=None):
        if self.given.shape != (probs.shape[0], top_k):
            raise ValueError(f"routing replay: {tuple(self.given.shape)} given experts for {probs.shape[0]} tokens "
                             f"of top-{top_k}; the replayed routing must line up with the forward's tokens")
        weights, chosen = replay_route(probs, top_k, norm_topk_prob, self.given, own=own, weigh=weigh)
        # counted in the forward only: a layer recomputed in backward (gradient checkpointing, which may recompute
        # only the first layers: `decoder.recomputes`) replays the same choices, uncounted
        if self.stats is not None and torch._C._current_graph_task_id() == -1:
            self.stats.add(probs, chosen, self.given, own)
        return weights, chosen


class _Record:
    def __init__(self):
        self.chosen: list[torch.Tensor] = []

    def __call__(self, probs, top_k, norm_topk_prob, own=None, weigh=None):
        weights, chosen = own(probs) if own is not None else route(probs, top_k, norm_topk_prob)
        self.chosen.append(chosen.detach())
        return weights, chosen


@contextmanager
def replay_routing(model: nn.Module, given: torch.Tensor, stats: ReplayStats | None = None) -> Iterator[None]:
    """The forwards (and backward recomputations) inside the block route token t of MoE layer l to experts
    `given[t, l]` ((T, layers, k), in the forward's token order; -1 rows route by their own top-k); `stats`
    counts what replay changed."""
    blocks = sparse_blocks(model)
    if given.shape[1] != len(blocks):
        raise ValueError(f"routing replay: routing of {given.shape[1]} MoE layers for a model with {len(blocks)}")
    for i, block in enumerate(blocks):
        block.set_routing(_Replay(given[:, i], stats))
    try:
        yield
    finally:
        for block in blocks:
            block.set_routing(None)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the MoE layers' top-k choices of the forwards inside the block: yields, per layer, the (T, k) choices
    of each forward (read them after the block)."""
    blocks = sparse_blocks(model)
    hooks = [_Record() for _ in blocks]
    for block, hook in zip(blocks, hooks):
        block.set_routing(hook)
    try:
        yield [h.chosen for h in hooks]
    finally:
        for block in blocks:
            block.set_routing(None)
