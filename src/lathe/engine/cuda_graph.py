"""Decode steps replayed from CUDA graphs, one graph per batch bucket (1, 2, 4, 8, 16, 32, 48, ...).

A decode step of a small model is hundreds of small kernels; launched one by one from Python the GPU
mostly waits (transformers `generate` spends 65-78 ms a step whatever the model size). A graph
records the whole forward once per bucket and replays it with one launch. Inputs go through static
buffers sized for the largest bucket; a batch runs in the smallest bucket that holds it, its padding
rows writing their K/V to the cache's scratch slot and attending over one token (their outputs are
dropped). The block tables live on the device between steps; a step rewrites only the rows whose
sequence changed or gained a block. A bucket is captured the first time it is needed, after one eager warm-up run,
into a memory pool all buckets share.

The graphs hold the KV cache's and the weights' addresses: `update_weights` copies in place (graphs
stay valid), `sleep()` frees the cache, so the engine calls `reset()` then and buckets are captured
again after `wake_up()`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lathe import device as accel
from lathe.device import to_device
from lathe.engine.triton_decode import choose_num_splits


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device, width = runner.device, runner.max_blocks
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slots = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.tables = torch.zeros(self.max_batch, width, dtype=torch.int32, device=device)
        self.num_sms = accel.multiprocessor_count(device)
        self.host_tables = np.zeros((self.max_batch, width), dtype=np.int32)   # mirror of `tables`
        self.captures, self.capture_seconds = 0, 0.0        # since the engine was built (reset() keeps them)
        self.reset()

    def reset(self) -> None:
        """Forget every captured graph (the KV cache they point at is gone)."""
        self.graphs: dict[int, object] = {}          # batch bucket -> captured graph
        self.row_seq = [None] * self.max_batch      # the sequence whose table each row of `tables` holds,
        self.row_dealloc = [0] * self.max_batch     # at which of its allocations, how long, ending in which block
        self.row_len = [0] * self.max_batch
        self.row_last = [-1] * self.max_batch
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _forward(self, bucket: int) -> torch.Tensor:
        from lathe.engine.model_runner import DecodeAttention
        runner = self.runner
        splits = choose_num_splits(bucket, runner.model.config.num_key_value_heads, self.num_sms)
        attn = DecodeAttention(runner.kv_cache, self.slots[:bucket], self.tables[:bucket], self.lens[:bucket],
                               runner.decode_backend, splits if runner.decode_backend == "triton" else 1)
        return runner.model.model(self.input_ids[:bucket], self.positions[:bucket], attn)

    def _capture(self, bucket: int) -> None:
        start = time.perf_counter()
        self._forward(bucket)                       # warm-up: kernels compiled, workspaces allocated
        device = self.runner.device
        accel.synchronize(device)
        graph = accel.new_graph(device)
        if self.pool is None:
            self.pool = accel.graph_pool(device)
        with accel.capture(graph, device, pool=self.pool):
            self.outputs[bucket] = self._forward(bucket)
        self.graphs[bucket] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start

    def _sync_tables(self, seqs) -> None:
        """Bring the device block tables up to date, rewriting only rows whose sequence or blocks changed
        (a decode step changes a row when its sequence starts a block or copies a shared one)."""
        dirty = []
        row_seq, row_len, row_last, row_dealloc = self.row_seq, self.row_len, self.row_last, self.row_dealloc
        for i, seq in enumerate(seqs):
            table = seq.block_table
            if (row_seq[i] is seq and row_len[i] == len(table) and row_last[i] == table[-1]
                    and row_dealloc[i] == seq.num_deallocations):     # a preempted sequence comes back with new blocks
                continue
            self.host_tables[i, :len(table)] = table
            row_seq[i], row_len[i], row_last[i], row_dealloc[i] = seq, len(table), table[-1], seq.num_deallocations
            dirty.append(i)
        if not dirty:
            return
        lo, hi = dirty[0], dirty[-1] + 1
        self.tables[lo:hi].copy_(to_device(torch.from_numpy(self.host_tables[lo:hi]), self.tables.device))

    def run(self, seqs, ids: list[int], positions: list[int], slots: list[int], lens: list[int],
            pending=None) -> torch.Tensor:
        """Final hidden states (B, H) of one decode step; inputs as `ModelRunner.decode_inputs` makes them, and
        the input ids still on the device as `ModelRunner.take_pending` takes them."""
        batch = len(ids)
        bucket = self._bucket(batch)
        pad = bucket - batch
        scratch = self.runner.kv_cache.scratch_slot
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [scratch] * pad, lens + [1] * pad],
                            dtype=torch.int64)
        dev = to_device(host, self.input_ids.device)           # one copy, from pinned memory
        self.input_ids[:bucket].copy_(dev[0])
        self.positions[:bucket].copy_(dev[1])
        self.slots[:bucket].copy_(dev[2])
        self.lens[:bucket].copy_(dev[3])
        self.runner.take_pending(self.input_ids, pending)
        self._sync_tables(seqs)        # padding rows keep whatever table they hold: they read one token of it
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]
