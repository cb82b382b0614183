"""DecodeGraphs' device block tables: which rows a step rewrites (the bookkeeping runs on CPU here)."""

import numpy as np
import torch

from lathe.engine.block_manager import BlockManager
from lathe.engine.cuda_graph import DecodeGraphs, batch_buckets
from lathe.engine.sequence import Sequence


def _graphs(rows: int, width: int) -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)           # no CUDA: only the table mirror is exercised
    g.max_batch = rows
    g.tables = torch.zeros(rows, width, dtype=torch.int32)
    g.host_tables = np.zeros((rows, width), dtype=np.int32)
    g.reset()
    return g


def test_buckets_cover_every_batch_size():
    buckets = batch_buckets(100)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 100
    assert all(any(b >= n for b in buckets) for n in range(1, 101))


def test_tables_follow_new_blocks_copy_on_write_and_reallocation():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a, b = Sequence(list(range(6))), Sequence(list(range(10, 13)))
    bm.allocate(a)
    bm.allocate(b)
    g = _graphs(4, 8)

    def check():
        g._sync_tables([a, b])
        for row, seq in enumerate((a, b)):
            assert g.tables[row, :len(seq.block_table)].tolist() == seq.block_table

    check()
    for _ in range(3):                                   # a crosses into a new block
        a.append_token(1, 0.0)
        bm.may_append(a)
        check()
    first = list(a.block_table)
    bm.deallocate(a)                                     # preempted; readmitted with the same number of blocks
    a.block_table = [first[1], first[0], first[2]]       # and the same last block: only the epoch tells
    check()
