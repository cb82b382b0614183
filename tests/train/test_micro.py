"""Tests for lathe.train.micro: token-budget micro-batches (verl's use_dynamic_bsz) and restoring row order."""

import random

import pytest
import torch

from lathe.train.logprob import batched_token_stats
from lathe.train.micro import (HOST_MASK, in_batch_order, micro_batches, prompt_items, token_balanced_partitions,
                              with_host_mask)

from helpers import assert_close_rel

from .test_prefix_group import _grouped_batch


@pytest.mark.parametrize("seed", range(20))
def test_partitions_cover_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(max(lengths), 3 * max(lengths))
    groups = token_balanced_partitions(lengths, budget, key="k")
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    assert len(groups) >= -(-sum(lengths) // budget)              # no fewer than the token count allows
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_partitions_balance_and_use_the_fewest_groups_when_they_fit():
    lengths = [10, 10, 10, 10, 8, 8, 2, 2]           # 60 tokens, budget 20: three groups of 20 exist
    groups = token_balanced_partitions(lengths, 20, key="k")
    assert len(groups) == 3 and sorted(sum(lengths[i] for i in g) for g in groups) == [20, 20, 20]


def test_a_sequence_longer_than_the_budget_names_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=8: the longest sequence has 9 tokens.*"
                                         r"at least 9"):
        token_balanced_partitions([3, 9, 2], 8, key="ppo_max_token_len_per_gpu")


def test_micro_batches_by_tokens_and_back_in_order(rollout_batch):
    batch = rollout_batch(rows=9, seed=3)
    lengths = batch["attention_mask"].sum(-1)
    parts = micro_batches(batch, size=2, max_tokens=int(lengths.max()) + 3)
    assert len(parts) > 1 and all(int(mb["attention_mask"].sum()) <= int(lengths.max()) + 3 for mb, _ in parts)
    back = in_batch_order([(mb["input_ids"], rows) for mb, rows in parts])
    assert torch.equal(back, batch["input_ids"])
    plain = micro_batches(batch, size=4)
    assert [len(mb) for mb, _ in plain] == [4, 4, 1] and all(rows is None for _, rows in plain)
    assert torch.equal(in_batch_order([(mb["input_ids"], rows) for mb, rows in plain]), batch["input_ids"])


def test_grouped_micro_batches_keep_a_prompts_rows_together():
    """grouped (actor.use_prefix_grouper): a token budget packs whole prompts, each weighing its prompt once plus its
    responses, by `uid` where the batch has one, else by the prompt's tokens; a prompt over the budget alone goes as
    its rows; the log-probs equal the per-row pass's (tests/train/test_prefix_group.py's batch)."""
    batch = with_host_mask(_grouped_batch(n=4, shuffle=False))          # prompts of 3, 5 and 2 tokens, 4 rows each
    lengths = batch[HOST_MASK].sum(-1).tolist()
    P = batch["prompts"].shape[1]
    prompt = batch[HOST_MASK][:, :P].sum(-1).tolist()
    items = prompt_items(batch, lengths, 10 ** 6)
    assert [len(rows) for rows in items] == [4, 4, 4] and all(len({prompt[i] for i in rows}) == 1 for rows in items)
    cost = [sum(lengths[i] for i in rows) - 3 * prompt[rows[0]] for rows in items]
    budget = max(cost)
    parts = micro_batches(batch, size=1, max_tokens=budget, grouped=True)
    assert all(any(set(rows) <= set(r) for r in (rows_ for _, rows_ in parts)) for rows in items)   # whole prompts
    small = max(lengths)                                   # no prompt fits: its rows alone, as without grouping
    assert sorted(len(r) for _, r in micro_batches(batch, size=1, max_tokens=small, grouped=True)) == \
        sorted(len(r) for _, r in micro_batches(batch, size=1, max_tokens=small))
    batch["uid"] = ["a", "b", "c"] * 4                     # the uids say otherwise: they win
    assert sorted(map(sorted, prompt_items(batch, lengths, 10 ** 6))) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_grouped_token_budget_log_probs_equal_the_per_row_pass(make_lathe):
    batch = _grouped_batch(n=4, seed=5)
    model = make_lathe().eval()
    budget = int(batch["attention_mask"].sum(-1).max()) * 3
    plain = batched_token_stats(model, batch, micro_batch_size=2, max_tokens=budget)[0]
    grouped = batched_token_stats(model, batch, micro_batch_size=2, max_tokens=budget, prefix_grouper=True)[0]
    mask = batch["response_mask"].bool()
    assert_close_rel(grouped[mask], plain[mask], name="log-probs")
