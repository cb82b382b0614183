"""Cutting a batch into micro-batches: by sequence count, or packed by token count (verl's `use_dynamic_bsz`).

With a token budget (`ppo_max_token_len_per_gpu`, `log_prob_max_token_len_per_gpu`,
`forward_max_token_len_per_gpu`) the sequences, measured by their real tokens (prompt + response, the
`attention_mask`), go into the fewest micro-batches that each hold at most the budget, balanced so that
their token counts are close (largest first into the lightest micro-batch, LPT; one more micro-batch when
the balance overflows the budget). The losses are normalised by the whole mini-batch's counts, so the
update does not depend on the cut; outputs computed per micro-batch are put back in the batch's order.
"""

from __future__ import annotations

import heapq
import math

import torch

from lathe.batch import Batch
from lathe.train import parallel

HOST_MASK = "host_attention_mask"     # the attention mask in host memory (see `with_host_mask`)
HOST_PROMPT_IDS = "host_prompt_ids"   # the prompts' input ids and positions in host memory (`with_host_mask`,
HOST_PROMPT_POS = "host_prompt_positions"   # for the prefix-grouped forward)


def token_balanced_partitions(lengths: list[int], max_tokens: int, *, key: str, min_parts: int = 1
                              ) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most `max_tokens` tokens (`lengths[i]` for row i), each
    group in ascending order, groups ordered by their first row; at least `min_parts` of them (as many as there
    are rows at most). `key` names the budget in errors."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"{key}={max_tokens}: the longest sequence has {longest} tokens (prompt + response) "
                         f"and a micro-batch must hold it; raise {key} to at least {longest}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts = min(len(lengths), max(1, min_parts, math.ceil(sum(lengths) / max_tokens)))
    while True:
        heap = [(0, g) for g in range(parts)]             # (tokens, group): the lightest group first
        groups: list[list[int]] = [[] for _ in range(parts)]
        for i in order:
            load, g = heapq.heappop(heap)
            groups[g].append(i)
            heapq.heappush(heap, (load + lengths[i], g))
        if max(load for load, _ in heap) <= max_tokens:
            break
        parts += 1
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def micro_batches(batch: Batch, *, size: int, max_tokens: int | None = None, key: str = "max_token_len",
                  grouped: bool = False) -> list[tuple[Batch, list[int] | None]]:
    """(micro-batch, its rows in `batch` or None for consecutive chunks): `size` sequences each, or packed by
    `max_tokens` real tokens when given (see the module docstring). `grouped` (the prefix-grouped forward,
    `actor.use_prefix_grouper`): packed micro-batches take a prompt's rows together, weighing what the grouped
    forward computes (the prompt once, then every response), a group alone over the budget split into its rows.

    Data-parallel ranks (each holding its share of a batch) get the same number of micro-batches, since every
    micro-batch's forward gathers sharded weights together: packed ones are cut into as many as the rank that
    needs most, and fixed-size ones require equal shares."""
    batch = with_host_mask(batch, prompts=grouped)
    if max_tokens is None:
        parts = batch.split(size)
        if parallel.distributed() and parallel.max_over_ranks(len(parts)) != len(parts):
            raise ValueError(f"{len(batch)} rows on rank {parallel.rank()} make {len(parts)} micro-batches of {size}, "
                             "fewer than another rank's: data-parallel shares must be equal")
        return [(mb, None) for mb in parts]
    lengths = batch[HOST_MASK].sum(-1).tolist()
    items = prompt_items(batch, lengths, max_tokens) if grouped else [[i] for i in range(len(lengths))]

    def packed(min_parts: int = 1) -> list[list[int]]:
        costs = [_cost(rows, lengths, batch) for rows in items] if grouped else lengths
        parts = token_balanced_partitions(costs, max_tokens, key=key, min_parts=min_parts)
        return sorted((sorted(r for i in part for r in items[i]) for part in parts), key=lambda rows: rows[0])
    groups = packed()
    if parallel.distributed():
        most = parallel.max_over_ranks(len(groups))
        if most > len(lengths):
            raise ValueError(f"{key}={max_tokens}: another rank packs its share into {most} micro-batches but rank "
                             f"{parallel.rank()} has only {len(lengths)} rows; raise {key}")
        if most > len(items):           # fewer prompts than micro-batches: rows (each micro-batch groups its own)
            items = [[i] for i in range(len(lengths))]
        if most > len(groups):
            groups = packed(most)
    return [(batch.select(rows), rows) for rows in groups]


def prompt_items(batch: Batch, lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The batch's rows by prompt (its `uid` where the batch has one, else the prompt's tokens), in order of first
    appearance; a prompt whose grouped forward (`_cost`) would pass `max_tokens` as its rows one by one."""
    if "uid" in batch:
        keys = list(batch["uid"])
    else:
        prompts = batch[HOST_PROMPT_IDS] if HOST_PROMPT_IDS in batch else batch["prompts"].cpu()
        mask = batch[HOST_MASK][:, :batch["prompts"].shape[1]].bool()
        keys = [tuple(prompts[i][mask[i]].tolist()) for i in range(len(lengths))]
    members: dict = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    items = []
    for rows in members.values():
        items += [rows] if _cost(rows, lengths, batch) <= max_tokens else [[i] for i in rows]
    return items


def _cost(rows: list[int], lengths: list[int], batch: Batch) -> int:
    """Tokens of a prompt's rows in the prefix-grouped forward: every row's tokens, its prompt's counted once."""
    prompt = int(batch[HOST_MASK][rows[0], :batch["prompts"].shape[1]].sum())
    return sum(lengths[i] for i in rows) - (len(rows) - 1) * prompt


def with_host_mask(batch: Batch, *, prompts: bool = False) -> Batch:
    """`batch` with a host copy of its attention mask (`HOST_MASK`; one device-to-host copy), which micro-batches
    carry along: their packing and response positions are then worked out on the host, without waiting for the
    device (`lathe.train.logprob.host_layout`), so the host can queue a micro-batch while the previous one runs.
    `prompts` (the prefix-grouped forward): the prompts' input ids and positions too (`HOST_PROMPT_IDS`,
    `HOST_PROMPT_POS`), which group the rows (`lathe.train.prefix_group.grouped_layout`)."""
    if "attention_mask" not in batch:
        return batch
    copies = {} if HOST_MASK in batch else {HOST_MASK: batch["attention_mask"].cpu()}
    if prompts and HOST_PROMPT_IDS not in batch:
        P = batch["prompts"].shape[1]
        copies |= {HOST_PROMPT_IDS: batch["input_ids"][:, :P].cpu(),
                   HOST_PROMPT_POS: batch["position_ids"][:, :P].cpu()}
    if not copies:
        return batch
    return Batch({**batch.tensors, **copies}, dict(batch.non_tensors), dict(batch.meta))


def in_batch_order(parts: list[tuple[torch.Tensor, list[int] | None]]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (rows first) back into the batch's row order."""
    if all(rows is None for _, rows in parts):
        return torch.cat([t for t, _ in parts])
    rows = torch.tensor([r for _, rs in parts for r in rs])
    out = torch.cat([t for t, _ in parts])
    return out[torch.argsort(rows).to(out.device)]
