"""Routing replay in the actor's forwards (verl's `actor.router_replay.mode`): the batch's `routed_experts`
(B, L, MoE layers, top-k) int16, aligned with `input_ids` (-1: no choice given, the token routes by its own top-k),
replayed in a forward over the batch; or the forward's own choices recorded into that layout. The update reports
`actor/routing_replay_changed`: the share of replayed (token, MoE layer) choices that differ from its router's own
top-k (what replay changed; `training/rollout_probs_diff_*` shows the log-probs' side).

- R3: the rollout engine recorded each token's choices (`lathe.engine.routing`, `rollout.base.to_batch` lays them
  out); the old-log-prob and update forwards replay them, so every token routes as it was sampled.
- R2: the old-log-prob forward records its choices (`recording`, returned as `routed_experts` beside
  `old_log_probs`); the update forwards replay them, so the policy ratio compares the same experts.

A forward runs either padded (every (B, L) position, row-major: the order its MoE layers see the tokens), packed
(the real tokens, row-major: `pack_padded`'s and `host_layout`'s order) or prefix-grouped (`grouped`, the actor's
`use_prefix_grouper`: each prompt once, then its rows' responses, `lathe.train.prefix_group.host_stream`);
`forward_order` gives the rows of the flattened batch the forward takes, in its order. A grouped forward replays a
prompt's choices from its group's first row (the engine's shared prefix carries one routing for all of them) and
records them into every row of the group. The replay wraps forward and backward, so that layers recomputed
in backward (gradient checkpointing) route as their forward did.

Under Ulysses sequence parallelism (`sp`, `lathe.train.ulysses`) a forward is packed and each rank of a group runs
its MoE layers on its slice of the stream, padded to divide by the group's size: replay hands each rank its slice of
the given choices (-1 at the padding: it routes by its own top-k, uncounted), and recording gathers the group's
slices back into the whole stream's choices (the padding's dropped), so every rank of the group holds the same
`routed_experts`, in the batch's layout, that one process records. A rank's `ReplayStats` count its slice's real
tokens; `replay_counts` sums them over the group (then the data-parallel sum counts each token once).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from lathe.batch import Batch
from lathe.device import array_to_device
from lathe.models.decoder import LatheCausalLM
from lathe.models.moe import sparse_blocks
from lathe.models.routing import ReplayStats, record_routing, replay_routing
from lathe.rollout.base import ROUTED
from lathe.train.logprob import host_layout
from lathe.train.micro import in_batch_order
from lathe.train.parallel import all_reduce
from lathe.train.prefix_group import host_stream
from lathe.train.ulysses import SequenceParallel, gather_tokens, local_slice


def forward_order(batch: Batch, remove_padding: bool, grouped: bool = False) -> torch.Tensor | None:
    """Rows of the flattened (B * L) batch that a forward takes, in its order; None: all of them (padded)."""
    if grouped:
        return array_to_device(host_stream(batch).src, batch["attention_mask"].device)
    if not remove_padding:
        return None
    layout = host_layout(batch)
    if layout is not None:
        return layout.indices
    return batch["attention_mask"].flatten().nonzero(as_tuple=True)[0]


def _packed_order(batch: Batch, remove_padding: bool, sp: SequenceParallel | None,
                  grouped: bool = False) -> torch.Tensor | None:
    """`forward_order`; refused under sequence parallelism unless packed (its forward always is)."""
    if sp is not None and not remove_padding:
        raise ValueError("routing replay with Ulysses sequence parallelism runs packed forwards "
                         "(actor_rollout_ref.model.use_remove_padding=true), got remove_padding=false")
    return forward_order(batch, remove_padding, grouped)


@contextmanager
def replaying(model, batch: Batch, remove_padding: bool, stats: ReplayStats | None = None,
              sp: SequenceParallel | None = None, grouped: bool = False) -> Iterator[None]:
    """Forwards (and backwards) over `batch` inside the block replay its `routed_experts` (`stats` counts what
    replay changed); without them, as usual. `sp`: this rank's sequence-parallel group; it replays its slice.
    `grouped`: the forwards are prefix-grouped."""
    routed = batch.tensors.get(ROUTED)
    if routed is None:
        yield
        return
    given = routed.flatten(0, 1)
    order = _packed_order(batch, remove_padding, sp, grouped)
    if order is not None:
        given = given.index_select(0, order.to(given.device))
    if sp is not None:                  # this rank's slice of the stream, -1 at the padding that makes it divide
        given = local_slice(given, sp, fill=-1)
    with replay_routing(model, given, stats):
        yield


class Recorded:
    """The choices of one forward over a batch, laid out as `routed_experts` (`recording`)."""

    value: torch.Tensor | None = None


@contextmanager
def recording(model, batch: Batch, remove_padding: bool, sp: SequenceParallel | None = None,
              grouped: bool = False) -> Iterator[Recorded]:
    """Record the choices of the one forward over `batch` inside the block; after it, `.value` holds them
    (B, L, layers, k) int16, -1 at the positions the forward skipped (padding, when packed). `sp`: this rank's
    sequence-parallel group, whose ranks each record their slice: the whole stream's choices, on every rank.
    `grouped`: a prefix-grouped forward, whose prompt choices go to every row of the group."""
    out = Recorded()
    with record_routing(model) as layers:
        yield out
    if not layers or len(layers[0]) != 1:
        raise RuntimeError(f"routing replay (R2): expected one forward's routing, got {len(layers[0])} per layer")
    chosen = torch.stack([layer[0] for layer in layers], dim=1)                     # (T, layers, k)
    B, L = batch["attention_mask"].shape
    if grouped:
        host = host_stream(batch)
        full = chosen.new_full((B * L, *chosen.shape[1:]), -1, dtype=torch.int16)
        every, held = (array_to_device(a, chosen.device) for a in (host.every, host.held))
        out.value = full.index_copy_(0, every, chosen.index_select(0, held).to(torch.int16)).view(
            B, L, *chosen.shape[1:])
        return
    order = _packed_order(batch, remove_padding, sp)
    if sp is not None:                  # the group's slices joined, the padding that made the stream divide dropped
        chosen = gather_tokens(chosen.long(), sp)[:len(order)]
    chosen = chosen.to(torch.int16)
    if order is None:
        out.value = chosen.view(B, L, *chosen.shape[1:])
        return
    full = chosen.new_full((B * L, *chosen.shape[1:]), -1)
    out.value = full.index_copy_(0, order.to(full.device), chosen).view(B, L, *chosen.shape[1:])


class LogProbRouting:
    """The old-log-prob pass's routing (`batched_token_stats`'s `around`, called per micro-batch with its rows):
    R3 replays the rollout's choices; R2 records its own, which `result` gives in the batch's row order."""

    def __init__(self, mode: str, model, remove_padding: bool, sp: SequenceParallel | None = None,
                 grouped: bool = False):
        self.mode, self.model, self.remove_padding, self.sp, self.grouped = mode, model, remove_padding, sp, grouped
        self.parts: list[tuple[torch.Tensor, list[int] | None]] = []

    @contextmanager
    def __call__(self, micro: Batch, rows: list[int] | None) -> Iterator[None]:
        if self.mode != "R2":
            with replay_or_nothing(self.model, micro, self.remove_padding, sp=self.sp, grouped=self.grouped):
                yield
            return
        with recording(self.model, micro, self.remove_padding, self.sp, self.grouped) as rec:
            yield
        self.parts.append((rec.value, rows))

    def result(self) -> torch.Tensor | None:
        """R2: the recorded (B, L, layers, k) int16 choices; else None."""
        return in_batch_order(self.parts) if self.parts else None


def replay_or_nothing(model, batch: Batch, remove_padding: bool, stats: ReplayStats | None = None,
                      sp: SequenceParallel | None = None, grouped: bool = False):
    """`replaying` when the batch carries routing, else a null context."""
    return replaying(model, batch, remove_padding, stats, sp, grouped) if ROUTED in batch else nullcontext()


def replay_counts(stats: ReplayStats, sp: SequenceParallel | None = None) -> dict[str, float]:
    """{changed, given}: `stats`' counts, summed over this rank's sequence-parallel group (each rank counted its
    slice's tokens), so that a sum over the data-parallel ranks counts every token once."""
    counts = [float(stats.changed), float(stats.given)]
    if sp is not None:
        counts = all_reduce(counts, group=sp.group).tolist()
    return dict(zip(("changed", "given"), counts))


def check_replay_model(model, mode: str) -> None:
    """Refuse, naming the key, a policy whose MoE layers routing replay cannot drive: no MoE layers (a dense model),
    transformers' implementation, or a vision-language model."""
    key = f"actor_rollout_ref.actor.router_replay.mode={mode}"
    if not isinstance(model, LatheCausalLM):
        raise ValueError(f"{key}: routing replay drives lathe's MoE text decoder (Qwen3-MoE, GPT-OSS, DeepSeek-V3, "
                         f"the Qwen3.5 / Qwen3-Next MoE layers), but the actor runs {type(model).__name__}. Fix: set "
                         "router_replay.mode=disabled, or actor_rollout_ref.model.impl=auto.")
    if not sparse_blocks(model):
        raise ValueError(f"{key}: {model.config.architecture} is a dense model (no mixture-of-experts layers to "
                         "replay). Fix: set router_replay.mode=disabled (and rollout.enable_rollout_routing_replay="
                         "false).")
