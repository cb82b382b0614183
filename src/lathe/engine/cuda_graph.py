"""Decode steps replayed from CUDA graphs, one graph per batch bucket (1, 2, 4, 8, 16, 32, 48, ...).

A decode step of a small model is hundreds of small kernels; launched one by one from Python the GPU
mostly waits, and the step takes about as long whatever the model size. A graph
records the whole step once per bucket and replays it with one launch: the forward, the lm_head, and the
fused sampler (`triton_sample.py`), so that a step's sampled tokens and log-probs come out of the graph and
nothing else is launched per step but the input copy.

Inputs go through one static (10, max batch) int64 buffer, written by one host-to-device copy per step (from
page-locked buffers kept for it, as the block tables' mirror is: `lathe.device.Staging`): token
ids, positions, the sampler's seeds, output positions, greedy flags, temperatures and top-p (float64 bit
patterns) and top-k, an image prompt's rope delta (VL models), and a hybrid model's linear-attention state slot
(Qwen3.5, Qwen3-Next: `linear_state.py`; padding rows take the states' scratch slot). Inside the graph, each row's
KV slot and context length come from its position and block table, and a text model's RoPE rows from a [cos | sin]
table of every position below max_model_len that the model's RotaryEmbedding computed once (`triton_step`: one
launch for all three; max_model_len x 2 x head_dim values, 16 MB at 32k positions and head_dim 128). A batch runs
in the smallest bucket that holds it (a bucket has up to four graphs: with and without the sampler's top-k and top-p
searches, which only batches that use them pay for); its padding rows (position -1) write their K/V to the
cache's scratch slot and attend over one token, and their outputs are dropped. The block tables live on
the device between steps; a step rewrites only the rows whose sequence changed or gained a block. A
bucket is captured the first time it is needed, after one eager warm-up run, into a memory pool all
buckets share. A batch the fused sampler cannot take (a min_tokens ban in force) uses the graph's
logits and the PyTorch sampler instead.

The graphs hold the KV cache's (and a hybrid model's states') and the weights' addresses: `update_weights` copies
in place (graphs stay valid); after a `sleep()` the engine keeps them when `wake_up()` finds the cache and the states
at their old addresses (the allocator kept the blocks), else it calls `reset()` and buckets are captured again.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from lathe import device as accel
from lathe.device import Staging
from lathe.engine import decode_forms, expert_parallel, triton_step
from lathe.engine.multimodal import hidden_states, rope_delta, text_config
from lathe.engine.sampler import FUSED_ROWS, fused_rows, sample_rows
from lathe.engine.step_attention import DecodeAttention
from lathe.engine.triton_decode import (SharedPrefix, choose_num_splits, pdl_available, prefix_splits,
                                        shared_prefixes)
from lathe.models.rope import RotaryEmbedding

# static input rows (SEED:DELTA: fused_rows; STATE: a hybrid model's linear-attention state slot)
IDS, POS, SEED, OUT_POS, GREEDY, TEMP, TOP_K, TOP_P, DELTA, STATE = range(10)
assert DELTA - SEED == FUSED_ROWS
_ONE = np.array(1.0).view(np.int64)
PAD = np.array([0, -1, 0, 0, 1, _ONE, 0, _ONE, 0, 0], dtype=np.int64)     # a padding row: greedy, scratch slot
# the shortest prompt prefix a group of rows attends over together (`DecodeGraphs._sync_prefix`), and where a token's
# K/V in a layer are at least 512 values (KV heads x head_dim), the shortest for those: on an H200 the group launch
# lost to every row reading a 256-token prompt on its own (L2 serves the group's rows), was even at 512 for 0.5B's
# and 1.5B's 2 x 64 and 2 x 128 (0.89-1.04x) and won there for 7B's 4 x 128 (1.08-1.22x); from 768 it won at all three
# (1.02-1.41x, `bench/results/decode_shared_prefix_nvidia-h200.json`)
PREFIX_MIN_TOKENS = 768
PREFIX_MIN_TOKENS_WIDE = 512


def prefix_min_tokens(kv_heads: int, head_dim: int) -> int:
    """The shortest shared prompt the decode graphs group rows over, for a layer's K/V of that width."""
    return PREFIX_MIN_TOKENS_WIDE if kv_heads * head_dim >= 512 else PREFIX_MIN_TOKENS


def prefix_group_rows(num_heads: int, num_kv_heads: int) -> int:
    """The most rows a shared-prefix group holds (its query heads one tile of at most 64 rows), or 0 where fewer than
    two fit."""
    rows = min(8, 64 // (num_heads // max(1, num_kv_heads)))
    return rows if rows >= 2 else 0


def batch_buckets(max_batch: int, sizes: list[int] | None = None) -> list[int]:
    """The decode batch sizes that get a graph (a step is padded to the next one; a larger step runs eagerly):
    `sizes` (verl's cudagraph_capture_sizes) capped at `max_batch`, else 1, 2, 4, 8, every 16th and `max_batch`."""
    if sizes and any(s >= 1 for s in sizes):
        return sorted({min(s, max_batch) for s in sizes if s >= 1})
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, sizes: list[int] | None = None):
        self.runner = runner
        self.buckets = batch_buckets(max_batch, sizes)
        self.max_batch = self.buckets[-1]
        device, width = runner.device, runner.max_blocks
        self.inputs = torch.zeros(len(PAD), self.max_batch, dtype=torch.int64, device=device)
        self.sampled = torch.zeros(2, self.max_batch, dtype=torch.float64, device=device)
        self.tables = torch.zeros(self.max_batch, width, dtype=torch.int32, device=device)
        self.num_sms = accel.multiprocessor_count(device)
        self.host_tables = Staging((self.max_batch, width), torch.int32, device)      # mirror of `tables`
        # the host side of `inputs`, two buffers used in turn (a step's copy may still be queued when the next
        # step writes its inputs); each is laid out for the step's bucket, (9, bucket) contiguous
        self.stages = [Staging((len(PAD) * self.max_batch,), torch.int64, device) for _ in range(2)]
        self.turn = 0
        from lathe.engine.triton_sample import triton
        self.samples = triton is not None
        # [cos | sin] of every position for the step-inputs kernel (text models; a VL model's 3D RoPE is its own)
        rotary = None if runner.vl else runner.model.model.rotary_emb
        self.rope_table = None
        if triton_step.available(device) and isinstance(rotary, RotaryEmbedding):
            self.rope_table = triton_step.rope_table(rotary, runner.max_model_len,
                                                     runner.model.get_input_embeddings().weight.dtype, device)
        # the decode kernel starts while the q/k/v projection drains (its lengths, slots and rows come from here)
        self.pdl = self.rope_table is not None and pdl_available(device)
        # rows sharing a prompt's blocks attend over it once per group (`triton_decode.paged_decode`'s `prefix`):
        # up to `prefix_rows` rows a group (its query heads one tile of at most 64 rows), the groups and each row's
        # prefix length in static buffers, recomputed on the host when the batch's rows change
        cfg = text_config(runner.model)
        self.prefix_rows = prefix_group_rows(cfg.num_attention_heads, cfg.num_key_value_heads) if (
            runner.shared_prefix and runner.decode_backend == "triton" and not runner.kv_cache.latent
            and runner.kv_cache.dtype == runner.model.dtype) else 0
        if self.prefix_rows:
            cap = self.max_batch // 2
            self.prefix_groups = torch.zeros(cap, 3, dtype=torch.int32, device=device)
            self.prefix_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
            self.prefix_stage = Staging((cap * 3 + self.max_batch,), torch.int32, device)
        self.prefix_split, self.prefix_batch = 0, -1
        self.captures, self.capture_seconds = 0, 0.0        # since the engine was built (reset() keeps them)
        self.reset()

    def reset(self) -> None:
        """Forget every captured graph (the KV cache they point at is gone)."""
        self.epoch = getattr(self, "epoch", -1) + 1     # (data-parallel attention: replicas compare theirs)
        self.graphs: dict[tuple, object] = {}        # (batch bucket, top-k search, top-p search) -> captured graph
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.pool = None
        self.forget_rows()

    def forget_rows(self) -> None:
        """Forget what the device block tables hold: the next step writes each row in use again."""
        self.prefix_batch = -1                          # (and the groups are found again)
        self.row_seq = [None] * self.max_batch      # the sequence whose table each row of `tables` holds,
        self.row_dealloc = [0] * self.max_batch     # at which of its allocations, how long, ending in which block
        self.row_len = [0] * self.max_batch
        self.row_last = [-1] * self.max_batch

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _forward(self, key: tuple) -> torch.Tensor:
        """One decode step over the static buffers for key = (bucket, top-k search, top-p search, prefix splits):
        logits (bucket, V); the sampled tokens and log-probs go to `sampled`."""
        bucket, use_k, use_p, psplits = key
        runner, inp, tables = self.runner, self.inputs[:, :bucket], self.tables[:bucket]
        bs, pos, scratch = runner.block_size, inp[POS], runner.kv_cache.scratch_slot
        if self.rope_table is not None:         # slots, lengths and RoPE rows in one launch
            slots, lens, cos, sin = triton_step.step_inputs(pos, tables, self.rope_table, bs, scratch)
            rope, positions = (cos, sin), pos       # the model takes the rows; positions go unused
        else:
            slots, lens = triton_step.step_inputs_torch(pos, tables, bs, scratch)
            rope, positions = None, pos.clamp_min(0)
            if runner.vl:
                positions = positions + inp[DELTA]      # an image prompt's tokens sit at index + delta
        cache = runner.kv_cache
        splits = choose_num_splits(bucket, text_config(runner.model).num_key_value_heads, self.num_sms,
                                   head_dim=cache.k[0].shape[-1], fp8=cache.quantized)
        attn = DecodeAttention(runner.kv_cache, slots, tables, lens, runner.decode_backend,
                               splits if runner.decode_backend == "triton" else 1,
                               split_k=decode_forms.step_split_k(runner.model, bucket), rope=rope, pdl=self.pdl,
                               rotates=runner.rotates,
                               prefix=SharedPrefix(self.prefix_groups[:bucket // 2], self.prefix_lens[:bucket],
                                                   psplits, self.prefix_rows) if psplits else None)
        if runner.states is not None:
            attn.linear_states = runner.states.decode_step(inp[STATE])
        logits = runner.model.lm_head(hidden_states(runner.model, inp[IDS], positions, attn))
        if self.samples:
            sample_rows(logits, inp[SEED:DELTA], out=self.sampled, use_k=use_k, use_p=use_p)
        return logits

    def _warm_up(self, key: tuple) -> None:
        """The step run once eagerly before its capture (kernels compiled, workspaces allocated; the capture only
        records, and the replay that follows runs the step). A hybrid model's rows run it on the states' scratch slot:
        what it writes to their KV slots the replay writes again, but a state it advanced would be advanced twice."""
        states = self.runner.states
        if states is None:
            self._forward(key)
            return
        slots = self.inputs[STATE].clone()
        self.inputs[STATE].fill_(states.scratch_slot)
        self._forward(key)
        self.inputs[STATE].copy_(slots)

    def _capture(self, key: tuple) -> None:
        """Capture the graph of `key`. A capture that runs out of device memory is tried once more after the caching
        allocator gives its unused blocks back to the driver: the graphs' pool takes new memory from the driver,
        and after a training step the allocator may hold most of the device unused (a larger batch first met
        mid-run, as colocate_async's rollout running ahead meets it)."""
        try:
            self._capture_once(key)
        except torch.OutOfMemoryError:
            self.graphs.pop(key, None)
            self.outputs.pop(key, None)
            accel.synchronize(self.runner.device)
            accel.empty_cache(self.runner.device)
            self._capture_once(key)

    def _capture_once(self, key: tuple) -> None:
        start = time.perf_counter()
        expert_parallel.STATIC_ROWS = True      # (data-parallel attention's experts: the graph's path, warm-up too)
        try:
            self._warm_up(key)
            device = self.runner.device
            accel.synchronize(device)
            graph = accel.new_graph(device)
            if self.pool is None:
                self.pool = accel.graph_pool(device)
            # the capture makes its own cuBLAS workspaces, inside the graphs' pool, and leaves none behind: then no
            # graph replays into a workspace outside its pool, and the engine may free those
            # (`accel.clear_blas_workspaces`, as inductor's CUDA graphs do around their captures)
            accel.clear_blas_workspaces(device)
            try:
                with accel.capture(graph, device, pool=self.pool):
                    self.outputs[key] = self._forward(key)
            finally:
                accel.clear_blas_workspaces(device)
        finally:
            expert_parallel.STATIC_ROWS = False
        self.graphs[key] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start

    def _sync_tables(self, seqs) -> None:
        """Bring the device block tables up to date, rewriting only rows whose sequence or blocks changed
        (a decode step changes a row when its sequence starts a block or copies a shared one). A row that only
        gained a block gets that one entry written, and all entries go in with one numpy assignment: writing a
        large batch's rows one by one from their lists is a visible share of a step's host time where the batch
        starts new blocks, and more at a call's first decode step."""
        dirty, full, rows, cols, vals = [], [], [], [], []
        row_seq, row_len, row_last, row_dealloc = self.row_seq, self.row_len, self.row_last, self.row_dealloc
        for i, seq in enumerate(seqs):
            table = seq.block_table
            n = len(table)
            same = row_seq[i] is seq and row_dealloc[i] == seq.num_deallocations   # a preempted sequence comes
            if same and row_len[i] == n and row_last[i] == table[-1]:               # back with new blocks
                continue
            if same and n == row_len[i] + 1 and table[-2] == row_last[i]:    # one block appended, the rest as held
                rows.append(i)
                cols.append(n - 1)
                vals.append(table[-1])
            else:
                full.append(i)
            row_seq[i], row_len[i], row_last[i], row_dealloc[i] = seq, n, table[-1], seq.num_deallocations
            dirty.append(i)
        if not dirty:
            return False
        if full:                                        # whole rows, flattened: one numpy assignment for all
            tables = [seqs[i].block_table for i in full]
            lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
            rows = np.concatenate([np.repeat(np.asarray(full), lens), np.asarray(rows, dtype=np.int64)])
            cols = np.concatenate([np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens),
                                   np.asarray(cols, dtype=np.int64)])
            vals = np.concatenate([np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64,
                                               count=int(lens.sum())), np.asarray(vals, dtype=np.int64)])
        self.host_tables.writable().numpy()[rows, cols] = vals
        lo, hi = dirty[0], dirty[-1] + 1
        self.host_tables.copy_to(self.tables[lo:hi], self.host_tables.tensor[lo:hi])
        return bool(full)

    def _sync_prefix(self, batch: int, lens: np.ndarray) -> None:
        """Find the batch's groups of rows sharing a prompt's blocks (`triton_decode.shared_prefixes`, from the host
        mirror of the tables) and write them, with each row's prefix length, to the graphs' static buffers; choose
        the prefix launch's splits (0: no group, the plain graph)."""
        cap = self.max_batch // 2
        _, _, kv_heads, head_dim = self.runner.kv_cache.k[0].shape
        groups, plens = shared_prefixes(self.host_tables.tensor.numpy()[:batch], lens, self.runner.block_size,
                                        max_rows=self.prefix_rows, min_tokens=prefix_min_tokens(kv_heads, head_dim),
                                        capacity=cap)
        self.prefix_split = prefix_splits(groups, kv_heads, head_dim, self.num_sms)
        self.prefix_batch = batch
        if self.prefix_split:
            host = self.prefix_stage.writable().numpy()
            host[:cap * 3] = np.asarray(groups, dtype=np.int32).reshape(-1)
            host[cap * 3:cap * 3 + batch] = plens
            host[cap * 3 + batch:] = 0
            staged = self.prefix_stage.tensor
            self.prefix_groups.view(-1).copy_(staged[:cap * 3], non_blocking=True)
            self.prefix_stage.copy_to(self.prefix_lens, staged[cap * 3:])

    def run(self, seqs, pending=None, sampling=None, agreed: tuple | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of `seqs`: (logits (B, V), sampled (2, B) float64 or None).

        `sampling`: `sampler.fused_settings` of the batch, or None when the fused sampler cannot take it (then
        `sampled` is None and the caller samples from the logits). Input ids still on the device are taken as
        `ModelRunner.take_pending` takes them. `agreed`: the graph's key (bucket >= the batch, top-k search, top-p
        search) that every replica of a data-parallel-attention engine runs this step (`LatheEngine._dp_agree`; an
        idle replica runs it with no sequences)."""
        batch = len(seqs)
        bucket = self._bucket(batch) if agreed is None else agreed[0]
        staging = self.stages[self.turn]
        self.turn ^= 1
        host = staging.writable()[:len(PAD) * bucket].view(len(PAD), bucket)
        stage = host.numpy()
        stage[IDS, :batch] = [s.token_ids[-1] for s in seqs]         # PENDING (-1) ones are written below
        stage[POS, :batch] = [len(s.token_ids) - 1 for s in seqs]
        if sampling is not None and self.samples:
            stage[SEED:DELTA, :batch] = fused_rows(seqs, sampling)
        else:
            stage[SEED:DELTA, :batch] = PAD[SEED:DELTA, None]
        stage[DELTA, :batch] = [rope_delta(s) for s in seqs] if self.runner.vl else 0
        stage[:, batch:bucket] = PAD[:, None]
        states = self.runner.states
        if states is not None:
            stage[STATE, :batch] = states.slots(seqs)
            stage[STATE, batch:bucket] = states.scratch_slot
        staging.copy_to(self.inputs[:, :bucket], host)
        self.runner.take_pending(self.inputs[IDS], pending)
        changed = self._sync_tables(seqs)   # padding rows keep whatever table they hold: they write the scratch slot
        psplits = 0
        if self.prefix_rows and agreed is None:     # (data-parallel attention's agreed graphs: without)
            if changed or batch != self.prefix_batch:   # rows only gaining blocks keep their groups
                self._sync_prefix(batch, stage[POS, :batch] + 1)
            psplits = self.prefix_split
        samples = sampling is not None and self.samples
        key = (bucket, samples and sampling.use_k, samples and sampling.use_p, psplits) if agreed is None \
            else (*agreed, 0)
        if key not in self.graphs:
            self._capture(key)
        self.graphs[key].replay()
        return self.outputs[key][:batch], self.sampled[:, :batch] if samples else None
