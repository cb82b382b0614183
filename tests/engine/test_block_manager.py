"""Tests for lathe.engine.block_manager: allocation, reference counts, prefix sharing, copy-on-write, reset."""

import pytest

from lathe.engine.block_manager import BlockManager
from lathe.engine.sequence import Sequence


def _seq(tokens):
    return Sequence(list(tokens))


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = _seq(range(10)), _seq(range(5))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert len(set(a.block_table) | set(b.block_table)) == 5
    assert bm.num_free_blocks == 3
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(2, 4)
    assert bm.can_allocate(_seq(range(8)))
    assert not bm.can_allocate(_seq(range(9)))


def test_samples_of_one_prompt_share_all_prompt_blocks():
    bm = BlockManager(8, 4)
    a, b = _seq(range(10)), _seq(range(10))
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == b.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 2]
    assert b.num_kv_cached == 10 and b.num_cached_tokens == 9   # the last token is recomputed for its logits
    assert a.num_cached_tokens == 0


def test_prefix_sharing_stops_at_first_different_block():
    bm = BlockManager(8, 4)
    a, b = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), _seq([1, 2, 3, 4, 5, 0, 7, 8, 9])
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table[0] == b.block_table[0]
    assert a.block_table[1:] != b.block_table[1:] and not set(a.block_table[1:]) & set(b.block_table[1:])
    assert b.num_cached_tokens == 4


def test_no_sharing_when_prefix_caching_off():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = _seq(range(6)), _seq(range(6))
    bm.allocate(a)
    bm.allocate(b)
    assert not set(a.block_table) & set(b.block_table) and b.num_cached_tokens == 0


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, 4)
    a, b = _seq(range(6)), _seq(range(6))
    bm.allocate(a)
    bm.allocate(b)
    shared = a.block_table[1]
    a.append_token(50, 0.0)
    assert bm.can_append(a)
    copies = bm.may_append(a)
    assert copies == [(shared, a.block_table[1])] and a.block_table[1] != shared
    assert a.block_table[0] == b.block_table[0] and b.block_table[1] == shared
    assert bm.blocks[shared].ref_count == 1
    b.append_token(60, 0.0)
    assert bm.may_append(b) == [] and b.block_table[1] == shared   # now private: written in place


def test_appending_to_private_block_unkeys_it_and_full_block_is_keyed():
    bm = BlockManager(8, 4)
    a = _seq(range(3))
    bm.allocate(a)
    a.append_token(3, 0.0)
    bm.may_append(a)                       # fills block 0: keyed as a full block
    c = _seq([0, 1, 2])                    # a's old partial content is gone: no hit
    d = _seq([0, 1, 2, 3, 9])              # but the full block now is
    bm.allocate(c)
    bm.allocate(d)
    assert c.block_table[0] != a.block_table[0]
    assert d.block_table[0] == a.block_table[0] and d.num_kv_cached == 4


def test_new_block_when_last_token_starts_one_and_can_append_when_full():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    a = _seq(range(4))
    bm.allocate(a)
    a.append_token(4, 0.0)
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 0
    b = _seq(range(4))
    with pytest.raises(IndexError):
        bm.allocate(b)


def test_freed_blocks_are_revived_by_a_later_hit():
    bm = BlockManager(4, 4)
    a = _seq(range(8))
    bm.allocate(a)
    table = list(a.block_table)
    bm.deallocate(a)
    b = _seq(range(8))
    bm.allocate(b)
    assert b.block_table == table and b.num_kv_cached == 8 and bm.num_free_blocks == 2


def test_reset_forgets_every_prefix():
    bm = BlockManager(4, 4)
    a = _seq(range(8))
    bm.allocate(a)
    bm.deallocate(a)
    bm.reset()
    b = _seq(range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.num_kv_cached == 0
    assert bm.num_free_blocks == 2


def test_resize_forgets_and_changes_capacity():
    bm = BlockManager(8, 4)
    a = _seq(range(10))
    bm.allocate(a)
    bm.resize(3)
    assert bm.num_blocks == 3 and bm.num_free_blocks == 3 and not bm.hash_to_block
    with pytest.raises(ValueError):
        bm.resize(0)


def test_reset_forgets_every_key_and_hands_out_each_block_once():
    """`reset` touches no block (constant time): the stale fields of blocks used before it never serve a prefix hit,
    and afterwards every block is handed out exactly once before any is reused."""
    bm = BlockManager(6, 2)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.deallocate(a)                                   # freed, keyed: would be revived by the same prompt
    bm.reset()
    assert bm.num_free_blocks == 6
    b = Sequence([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0                    # no hit from before the reset
    c = Sequence([9, 9, 9, 9, 9, 9])
    bm.allocate(c)
    assert sorted(b.block_table + c.block_table) == list(range(6)) and bm.num_free_blocks == 0
    bm.deallocate(c)
    d = Sequence([1, 2, 3, 4, 7])                      # shares b's two full blocks, then takes a freed one
    bm.allocate(d)
    assert d.num_cached_tokens == 4 and d.block_table[:2] == b.block_table[:2] and bm.num_free_blocks == 2
