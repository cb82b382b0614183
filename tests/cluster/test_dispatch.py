"""Data-parallel shares of a batch: equal sizes, token balance, mini-batch-preserving update cuts, order kept."""

from __future__ import annotations

import pytest
import torch

from lathe.batch import GHOST, Batch, real_rows
from lathe.cluster.dispatch import (contiguous_shares, equal_partitions, for_groups, in_order, one_per_group,
                                    select_share, update_shares)

pytestmark = pytest.mark.no_ray             # pure functions: either xdist worker (tests/cluster/conftest.py)


def batch_of(lengths: list[int], width: int = 12) -> Batch:
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return Batch({"attention_mask": mask, "row": torch.arange(len(lengths))})


def test_equal_partitions_are_equal_sized_and_balanced():
    lengths = [12, 1, 11, 2, 10, 3, 9, 4]
    parts = equal_partitions(lengths, 2, balance=True)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(len(p) == 4 for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 2                       # contiguous halves would differ by 16
    assert equal_partitions(lengths, 2, balance=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_update_shares_keep_each_mini_batch_together():
    b = batch_of([12, 1, 11, 2, 10, 3, 9, 4, 5, 6, 7, 8])
    shares = update_shares(b, 2, mini_batch_size=4, balance=True)
    per_rank_mini = 2
    for j in range(3):       # the ranks' j-th mini-batches together are the undivided j-th mini-batch
        rows = {i for s in shares for i in s[j * per_rank_mini:(j + 1) * per_rank_mini]}
        assert rows == set(range(4 * j, 4 * j + 4))



def test_prompt_groups_are_dealt_whole_when_they_divide(caplog, monkeypatch):
    """actor.use_prefix_grouper: balanced shares keep a prompt's rows on one rank (dealt by their groups' tokens),
    in the update's mini-batches too; groups of unequal sizes or a count that does not divide fall back to rows,
    with one warning."""
    lengths = [12, 1, 11, 2, 10, 3, 9, 4, 5, 6, 7, 8]
    uids = [f"p{i // 3}" for i in range(12)]                  # 4 prompts x 3 rows, rows of a prompt together
    b = batch_of(lengths)
    b["uid"] = uids
    parts = equal_partitions(lengths, 2, balance=True, groups=uids)
    assert all(len({uids[i] for i in p}) == 2 and len(p) == 6 for p in parts)       # two whole prompts each
    assert sorted(i for p in parts for i in p) == list(range(12))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 6                         # weights 24, 15, 18, 21: 45 / 33 contiguous
    shares = update_shares(b, 2, mini_batch_size=6, balance=True, keep_groups=True)
    for share in shares:                                        # each rank: one whole prompt of each mini-batch
        assert [len({uids[i] for i in share[j * 3:(j + 1) * 3]}) for j in range(2)] == [1, 1]
    import lathe.cluster.dispatch as dispatch
    monkeypatch.setattr(dispatch, "_WARNED_GROUPS", False)            # (another test of this process may have warned)
    with caplog.at_level("WARNING", logger="lathe.cluster.dispatch"):
        rows = equal_partitions(lengths, 3, balance=True, groups=uids)                 # 4 prompts over 3 ranks
        assert equal_partitions(lengths[:5], 1, balance=True, groups=uids[:5]) == [[0, 1, 2, 3, 4]]
    assert rows == equal_partitions(lengths, 3, balance=True)                           # dealt by rows
    assert sum("cannot be dealt whole" in r.getMessage() for r in caplog.records) == 1     # once, for two fallbacks

def test_in_order_restores_the_batch_order():
    b = batch_of([5, 9, 2, 7, 3, 8])
    shares = equal_partitions([5, 9, 2, 7, 3, 8], 3, balance=True)
    parts = [b.select(s) for s in shares]
    assert in_order(parts, shares)["row"].tolist() == list(range(6))


def test_ghost_rows_pad_uneven_cuts_add_nothing_and_are_dropped_from_the_answers():
    """6 rows of mini-batches of 3 over 2 ranks: each rank's share of each mini-batch padded to 2 (a ghost row: the
    shortest row, no response tokens, marked); the answers in batch order without the ghosts."""
    lengths = [5, 9, 2, 7, 3, 8]
    b = batch_of(lengths)
    b["response_mask"] = b["attention_mask"].clone()
    shares = update_shares(b, 2, mini_batch_size=3, balance=True, ghosts=True)
    assert [len(s) for s in shares] == [4, 4] and sum(i < 0 for s in shares for i in s) == 2
    for j in range(2):       # each mini-batch's real rows, once, in the ranks' j-th parts
        rows = [i for s in shares for i in s[2 * j:2 * j + 2] if i >= 0]
        assert sorted(rows) == [3 * j, 3 * j + 1, 3 * j + 2]
    parts = [select_share(b, s) for s in shares]
    for part, share in zip(parts, shares):
        ghost = torch.tensor([i < 0 for i in share])
        marked = part[GHOST] if GHOST in part else torch.zeros(len(part), dtype=torch.bool)   # (none: unmarked)
        assert torch.equal(marked, ghost) and real_rows(part) == int((~ghost).sum())
        assert part["response_mask"][ghost].sum() == 0 and (part["attention_mask"][ghost].sum(-1) == 2).all()
    assert in_order(parts, shares)["row"].tolist() == list(range(6))
    assert equal_partitions([4, 1, 6], 2, balance=False, ghosts=True) == [[0, 1], [2, -1]]
    assert GHOST not in select_share(b, [0, 1]) and real_rows(b) == 6        # an even cut is left as it was


def test_contiguous_shares_cover_uneven_counts():
    assert [list(r) for r in contiguous_shares(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in contiguous_shares(1, 3)] == [1, 0, 0]


def test_a_sequence_parallel_group_gets_one_share_and_gives_one_answer():
    """Ranks 2g, 2g+1 form group g (`lathe.train.ulysses`): both get share g; group g's first rank answers."""
    assert for_groups(["a", "b"], 2) == ["a", "a", "b", "b"]
    assert for_groups(["a", "b"], 1) == ["a", "b"]
    assert one_per_group(["a0", "a1", "b0", "b1"], 2) == ["a0", "b0"]


def test_the_actor_group_keeps_prompts_whole_where_the_actor_groups_them():
    """ActorRolloutRefGroup(keep_groups=True): the old-log-prob, reference and update passes deal whole prompts;
    without it, rows balanced by tokens (which here split every prompt)."""
    from lathe.cluster.roles import ActorRolloutRefGroup

    class Group:
        world_size = 2

        def __init__(self):
            self.seen = {}

        def call_each(self, role, method, calls):
            parts = [args[0] for args, _ in calls]
            self.seen[method] = [list(p["uid"]) for p in parts]
            return [{} if method == "update_actor" else p for p in parts]

    lengths = [12, 11, 10, 9, 4, 3, 2, 1]                   # a prompt's two rows alike: dealing rows splits them
    b = batch_of(lengths)
    b["uid"] = [f"p{i // 2}" for i in range(8)]
    for keep in (True, False):
        group = Group()
        actor = ActorRolloutRefGroup(group, pad_id=0, mini_batch_size=8, balance=True, has_ref=True,
                                     keep_groups=keep)
        actor.compute_log_prob(b)
        actor.compute_ref_log_prob(b)
        actor.update_actor(b)
        for method in ("compute_log_prob", "compute_ref_log_prob", "update_actor"):
            assert all(len(set(uids)) == (2 if keep else 4) for uids in group.seen[method]), (keep, method)
