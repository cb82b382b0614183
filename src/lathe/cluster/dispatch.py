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

import torch

from lathe.batch import GHOST, Batch


def equal_partitions(lengths: list[int], parts: int, *, balance: bool, ghosts: bool = False) -> list[list[int]]:
    """`parts` lists of row indices with len(lengths) / parts rows each (ascending in each list): consecutive
    chunks, or balanced by `lengths` (largest first into the lightest part that is not full). With `ghosts`, a
    count that does not divide is padded with ghost rows (-1, as long as the shortest row; the module doc), which
    come last in their lists."""
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


def row_tokens(batch: Batch) -> list[int]:
    """Real tokens per row (prompt + response): what a row costs a forward."""
    return batch["attention_mask"].sum(-1).tolist()


def even_shares(batch: Batch, world: int, *, balance: bool, ghosts: bool = False) -> list[list[int]]:
    return equal_partitions(row_tokens(batch), world, balance=balance, ghosts=ghosts)


def update_shares(batch: Batch, world: int, *, mini_batch_size: int, balance: bool,
                  ghosts: bool = False) -> list[list[int]]:
    """Each rank's rows for an update over mini-batches of `mini_batch_size` rows (see the module docstring); with
    `ghosts`, each mini-batch padded to a multiple of `world` rows (each rank's part of it ceil(size / world))."""
    if len(batch) % mini_batch_size or (mini_batch_size % world and not ghosts):
        raise ValueError(f"an update over {len(batch)} rows in mini-batches of {mini_batch_size} cannot be split "
                         f"evenly over {world} data-parallel ranks")
    tokens = row_tokens(batch)
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, len(batch), mini_batch_size):
        rows = range(start, start + mini_batch_size)
        parts = equal_partitions([tokens[i] for i in rows], world, balance=balance, ghosts=ghosts)
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
