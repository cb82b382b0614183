"""Cutting a `Batch` into data-parallel shares and joining the ranks' answers, in batch order.

Two cuts:

- `even_shares`: rows split into `world` equal shares (the log-prob, reference and value passes). With
  `balance`, verl's `trainer.balance_batch`: rows are dealt so that the shares hold close real-token counts
  (largest first into the lightest share that still has room), and the outputs are put back in order.
- `update_shares`: the same, mini-batch by mini-batch, for an update: rank r's share is the r-th part of
  mini-batch 0, then of mini-batch 1, ... so that when each rank cuts its share into mini-batches of
  `mini_batch_size / world` rows, the ranks' j-th mini-batches together are exactly the undivided run's
  j-th mini-batch, and an update (normalised by whole-mini-batch counts) is the same however many ranks run it.

Where the rows do not divide over the ranks (a mini-batch of 24 sequences over 48 data-parallel ranks, as verl's
Megatron scripts give when lathe runs their pipeline stages as FSDP sharding), `ghosts=True` pads each cut with
ghost rows to the next multiple of the ranks, so every rank has as many rows (and as many micro-batches: the FSDP
collectives of every forward and backward must match). A ghost row is a copy of the batch's shortest row with no
response tokens (`response_mask` 0) and `GHOST` set: it adds no loss, no token or sequence to any count, and its
answers are dropped when the ranks' answers are joined (`in_order`). In a share, a ghost row's index is -1.

With Ulysses sequence parallelism of size S (`lathe.train.ulysses`) a batch is cut into world / S data-parallel
shares, each share goes to the S consecutive ranks of its sequence-parallel group (`for_groups`), which compute it
together and answer alike, and one answer per group is kept (`one_per_group`).
"""

from __future__ import annotations

import heapq
import logging

import torch

from lathe.batch import GHOST, Batch

log = logging.getLogger(__name__)


def equal_partitions(lengths: list[int], parts: int, *, balance: bool, ghosts: bool = False,
                     groups: list | None = None) -> list[list[int]]:
    """`parts` lists of row indices with len(lengths) / parts rows each (ascending in each list): consecutive
    chunks, or balanced by `lengths` (largest first into the lightest part that is not full). With `ghosts`, a
    count that does not divide is padded with ghost rows (-1, as long as the shortest row; the module doc), which
    come last in their lists. `groups` (a key per row: the prompt's `uid`, where the actor groups rows by prompt,
    `actor.use_prefix_grouper`): balanced parts deal whole groups, as long as the groups are all of one size and
    their count divides over the parts (as verl keeps them together); else rows, with one warning."""
    if groups is not None and balance:
        dealt = _deal_groups(lengths, parts, groups)
        if dealt is not None:
            return dealt
    n = len(lengths)
    if n % parts and ghosts:
        pad = -n % parts
        groups = equal_partitions([*lengths, *[min(lengths, default=0)] * pad], parts, balance=balance)
        return [[i for i in g if i < n] + [-1] * sum(i >= n for i in g) for g in groups]
    if n % parts:
        raise ValueError(f"{n} rows cannot be split evenly over {parts} data-parallel ranks")
    size = n // parts
    if not balance:
        return [list(range(r * size, (r + 1) * size)) for r in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, r) for r in range(parts)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        groups[r].append(i)
        if len(groups[r]) < size:
            heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(g) for g in groups]


def _deal_groups(lengths: list[int], parts: int, groups: list) -> list[list[int]] | None:
    """Whole groups of rows dealt as `equal_partitions` deals rows (each group weighing its rows' tokens), or None
    (with a warning, once) where they cannot be dealt evenly."""
    members: dict = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    sizes = {len(rows) for rows in members.values()}
    if len(sizes) != 1 or len(members) % parts:
        global _WARNED_GROUPS
        if not _WARNED_GROUPS:
            _WARNED_GROUPS = True
            log.warning("use_prefix_grouper: the rows of %d prompts (of %s rows each) cannot be dealt whole to %d "
                        "data-parallel ranks, so they are dealt row by row and a prompt's rows may run on several "
                        "ranks (each groups what it holds: the same result, its prompt computed once per rank). "
                        "Fix: a batch of whole groups whose count is a multiple of the ranks", len(members),
                        "/".join(map(str, sorted(sizes))), parts)
        return None
    per_part = len(members) // parts
    dealt: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, r) for r in range(parts)]
    weight = {key: sum(lengths[i] for i in rows) for key, rows in members.items()}
    for key in sorted(members, key=lambda k: (-weight[k], members[k][0])):
        load, r = heapq.heappop(heap)
        dealt[r] += members[key]
        if len(dealt[r]) < per_part * len(members[key]):
            heapq.heappush(heap, (load + weight[key], r))
    return [sorted(part) for part in dealt]


_WARNED_GROUPS = False


def row_tokens(batch: Batch) -> list[int]:
    """Real tokens per row (prompt + response): what a row costs a forward."""
    return batch["attention_mask"].sum(-1).tolist()


def prompt_groups(batch: Batch, keep_groups: bool) -> list | None:
    """The rows' prompt keys (`uid`) where whole prompt groups should stay on one rank (`equal_partitions`)."""
    return list(batch["uid"]) if keep_groups and "uid" in batch else None


def even_shares(batch: Batch, world: int, *, balance: bool, ghosts: bool = False,
                keep_groups: bool = False) -> list[list[int]]:
    return equal_partitions(row_tokens(batch), world, balance=balance, ghosts=ghosts,
                            groups=prompt_groups(batch, keep_groups))


def update_shares(batch: Batch, world: int, *, mini_batch_size: int, balance: bool,
                  ghosts: bool = False, keep_groups: bool = False) -> list[list[int]]:
    """Each rank's rows for an update over mini-batches of `mini_batch_size` rows (see the module docstring); with
    `ghosts`, each mini-batch padded to a multiple of `world` rows (each rank's part of it ceil(size / world));
    `keep_groups`: a mini-batch's prompt groups dealt whole (`equal_partitions`)."""
    if len(batch) % mini_batch_size or (mini_batch_size % world and not ghosts):
        raise ValueError(f"an update over {len(batch)} rows in mini-batches of {mini_batch_size} cannot be split "
                         f"evenly over {world} data-parallel ranks")
    tokens, keys = row_tokens(batch), prompt_groups(batch, keep_groups)
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, len(batch), mini_batch_size):
        rows = range(start, start + mini_batch_size)
        parts = equal_partitions([tokens[i] for i in rows], world, balance=balance, ghosts=ghosts,
                                 groups=None if keys is None else [keys[i] for i in rows])
        for r, part in enumerate(parts):
            shares[r] += [start + i if i >= 0 else -1 for i in part]
    return shares


def select_share(batch: Batch, share: list[int]) -> Batch:
    """The rows of `share` (-1: a ghost row, the module doc) as one batch."""
    if min(share, default=0) >= 0:
        return batch.select(share)
    shortest = min(range(len(batch)), key=row_tokens(batch).__getitem__)
    out = batch.select([i if i >= 0 else shortest for i in share])
    ghost = torch.tensor([i < 0 for i in share])
    out["response_mask"] = out["response_mask"] * ~ghost.to(out["response_mask"].device).unsqueeze(-1)
    out[GHOST] = ghost
    return out


def contiguous_shares(n: int, world: int) -> list[range]:
    """`n` items over `world` ranks as consecutive ranges, sizes differing by at most one (rollout prompts)."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        out.append(range(start, start + size))
        start += size
    return out


def in_order(parts: list[Batch], shares: list[list[int]]) -> Batch:
    """The ranks' answers (row i of `parts[r]` answers row `shares[r][i]`) as one batch in the original order; the
    ghost rows' answers (-1) dropped."""
    joined = Batch.concat([_without(p, GHOST) if GHOST in p else p for p in parts])
    index = torch.tensor([i for share in shares for i in share])
    real = torch.nonzero(index >= 0).flatten()
    return joined.select(real[torch.argsort(index[real])])


def for_groups(calls: list, sp: int) -> list:
    """Each data-parallel share's call for every rank of its group of `sp` consecutive ranks (a sequence-parallel
    group, or a tensor-parallel engine replica)."""
    return [call for call in calls for _ in range(sp)]


def one_per_group(answers: list, sp: int) -> list:
    """The first answer of each group of `sp` consecutive ranks (its ranks answer alike, or only its first)."""
    return answers[::sp]


def _without(batch: Batch, key: str) -> Batch:
    return Batch({k: v for k, v in batch.tensors.items() if k != key}, dict(batch.non_tensors), dict(batch.meta))
