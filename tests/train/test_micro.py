"""Tests for lathe.train.micro: token-budget micro-batches (verl's use_dynamic_bsz) and restoring row order."""

import random

import pytest
import torch

from lathe.train.micro import in_batch_order, micro_batches, token_balanced_partitions


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
