"""Cutting a `Batch` into data-parallel shares and joining the ranks' answers, in batch order.

Two cuts:

- `even_shares`: rows split into `world` equal shares (the log-prob, reference and value passes). With
  `balance`, verl's `trainer.balance_batch`: rows are dealt so that the shares hold close real-token counts
  (largest first into the lightest share that still has room), and the outputs are put back in order.
- `update_shares`: the same, mini-batch by mini-batch, for an update: rank r's share is the r-th part of
  mini-batch 0, then of mini-batch 1, ... so that when each rank cuts its share into mini-batches of
  `mini_batch_size / world` rows, the ranks' j-th mini-batches together are exactly the undivided run's
  j-th mini-batch, and an update (normalised by whole-mini-batch counts) is the same however many ranks run it.

With Ulysses sequence parallelism of size S (`lathe.train.ulysses`) a batch is cut into world / S data-parallel
shares, each share goes to the S consecutive ranks of its sequence-parallel group (`for_groups`), which compute it
together and answer alike, and one answer per group is kept (`one_per_group`).
"""

from __future__ import annotations

import heapq

import torch

from lathe.batch import Batch


def equal_partitions(lengths: list[int], parts: int, *, balance: bool) -> list[list[int]]:
    """`parts` lists of row indices with len(lengths) / parts rows each (ascending in each list): consecutive
    chunks, or balanced by `lengths` (largest first into the lightest part that is not full)."""
    n = len(lengths)
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


def even_shares(batch: Batch, world: int, *, balance: bool) -> list[list[int]]:
    return equal_partitions(row_tokens(batch), world, balance=balance)


def update_shares(batch: Batch, world: int, *, mini_batch_size: int, balance: bool) -> list[list[int]]:
    """Each rank's rows for an update over mini-batches of `mini_batch_size` rows (see the module docstring)."""
    if len(batch) % mini_batch_size or mini_batch_size % world:
        raise ValueError(f"an update over {len(batch)} rows in mini-batches of {mini_batch_size} cannot be split "
                         f"evenly over {world} data-parallel ranks")
    tokens = row_tokens(batch)
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, len(batch), mini_batch_size):
        rows = range(start, start + mini_batch_size)
        for r, part in enumerate(equal_partitions([tokens[i] for i in rows], world, balance=balance)):
            shares[r] += [start + i for i in part]
    return shares


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
    """The ranks' answers (row i of `parts[r]` answers row `shares[r][i]`) as one batch in the original order."""
    joined = Batch.concat(parts)
    order = torch.argsort(torch.tensor([i for share in shares for i in share]))
    return joined.select(order)


def for_groups(calls: list, sp: int) -> list:
    """Each data-parallel share's call for every rank of its group of `sp` consecutive ranks (a sequence-parallel
    group, or a tensor-parallel engine replica)."""
    return [call for call in calls for _ in range(sp)]


def one_per_group(answers: list, sp: int) -> list:
    """The first answer of each group of `sp` consecutive ranks (its ranks answer alike, or only its first)."""
    return answers[::sp]
