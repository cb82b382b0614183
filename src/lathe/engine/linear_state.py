"""The per-sequence states of the linear-attention layers of a hybrid model (Qwen3.5, Qwen3-Next:
`lathe.models.qwen3_5`; Nemotron-H's Mamba2 layers: `lathe.models.nemotron_h`), kept beside the paged KV cache of
its full-attention layers.

Each running sequence holds one slot of `LinearStateCache`: per linear layer, its last K-1 convolution inputs and
its recurrent state (float32): (Hv, Dk, Dv) for a gated-DeltaNet layer, (H, P, N) for a Mamba2 layer
(`state_layout`). A slot is taken, zeroed, the first time a step runs the sequence, and given back
whenever the block manager frees the sequence's blocks (finish, preemption, a weight sync's interruption):
a preempted sequence is recomputed from its tokens, from a zero state, like its KV. Prefix caching is off for these
models (a cached prefix has KV but no state to continue from: state snapshots at block boundaries are not built);
instead the `n` samples of a prompt fork from its first sample once its prompt is computed (`Scheduler`): they share
its KV blocks and start from copies of its states (`fork`), so the prompt is prefilled once; and a finished streamed
sequence is parked, its blocks and slot kept for a prompt that continues it (`StateBlockManager`).
With `kv_cache_dtype="fp8"` only the full-attention layers' K/V are FP8 (`kv_cache`); these states keep their dtypes
(a recurrent state is updated in place every token: quantising it would compound the rounding).

A step's `LinearStep` rides on the step's attention callable (`attn.linear_states`): the layers read and write the
states of the step's sequences, one linear layer after the other (gathered by slot with `index_select`, written back
with `index_copy_`). A step of one token per sequence (every decode step) instead hands each layer's inputs to the
`LinearStep`, which advances the states where they lie: on CUDA the convolution inputs and the recurrent state in
one Triton launch each per layer that reads and writes each row's slot (`triton_gdn`: a third of the gather /
kernel / scatter traffic; Mamba2's scan: `triton_ssd`, one pass over the states where PyTorch took about eleven).

Decode steps replay CUDA graphs as the other families' do (`cuda_graph.py`): a decode step's layers take one token
per sequence (`GatedDeltaNet`'s single-token form: no host sync), and the graph's `LinearStep` reads the rows' slots
from a static row of its input buffer, written before each replay, with `cu_seqlens` fixed by the bucket. The
Python-side layer counter only runs while a graph is captured: each layer's captured gather and scatter address its
own layer's states. A bucket's padding rows point at one extra slot past `num_slots` that no sequence is given (the
scratch slot, as the KV cache's scratch block): what they read and write there is never read by a real row. So do
all rows in the eager warm-up run before a bucket's capture, which would otherwise advance their states once more
than the replay that follows (`DecodeGraphs._warm_up`). The graphs hold the states' addresses, like the KV cache's:
`sleep` frees the states (they may take a large share of the device, which training needs; kept at a fixed address
they would not be freed), and `wake_up` keeps the graphs only when the states and the cache come back where they were
(the allocator kept their blocks), else captures them again.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

import torch

from lathe.engine import triton_gdn, triton_ssd
from lathe.engine.block_manager import BlockManager, _salt
from lathe.engine.sequence import Sequence
from lathe.models.linear_attention import conv_step, recurrent_gated_delta_rule
from lathe.models.ssd import scan_step

log = logging.getLogger("lathe")


class LinearStateCache:
    """Convolution and recurrent states of `num_slots` sequences for every linear-attention layer of `cfg`."""

    def __init__(self, cfg, num_slots: int, *, dtype: torch.dtype, device: torch.device):
        layers, conv_dim, kernel, recurrent = state_layout(cfg)
        self.num_slots = num_slots          # + the scratch slot (`scratch_slot`), never given to a sequence
        self.shapes = ((layers, num_slots + 1, conv_dim, kernel - 1), (layers, num_slots + 1, *recurrent))
        self.dtype, self.device = dtype, device
        self.conv = self.recurrent = None
        self.reclaim = None         # frees a slot when none is free (`StateBlockManager.evict_one`): True if it did
        self.allocate()

    @property
    def scratch_slot(self) -> int:
        """The slot a decode graph's padding rows read and write (module doc)."""
        return self.num_slots

    @property
    def address(self) -> tuple[int, int] | None:
        """Where the states live, or None when freed: a decode graph captured against one address runs only there."""
        return None if self.conv is None else (self.conv.data_ptr(), self.recurrent.data_ptr())

    def allocate(self) -> None:
        """(Re)create the states, every slot free (the engine's `wake_up`)."""
        if self.conv is None:
            self.conv = torch.zeros(self.shapes[0], dtype=self.dtype, device=self.device)
            self.recurrent = torch.zeros(self.shapes[1], dtype=torch.float32, device=self.device)
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.slot: dict[Sequence, int] = {}

    def free_memory(self) -> None:
        """Drop the states (the engine's `sleep`: no sequence holds a slot then)."""
        self.conv = self.recurrent = None

    def slots(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's slot, a zeroed one for a sequence that has none."""
        out = []
        for seq in seqs:
            if seq not in self.slot:
                slot = self.slot[seq] = self._take()
                self.conv[:, slot].zero_()
                self.recurrent[:, slot].zero_()
            out.append(self.slot[seq])
        return out

    def _take(self) -> int:
        while not self.free and self.reclaim is not None and self.reclaim():
            pass
        if not self.free:
            raise RuntimeError("linear-attention states: more running sequences than slots (max_num_seqs); "
                               "this is a bug")
        return self.free.pop()

    def adopt(self, old: Sequence, new: Sequence) -> None:
        """`new` takes over `old`'s slot (a parked sequence's states, which it continues)."""
        self.slot[new] = self.slot.pop(old)

    def fork(self, seq: Sequence, followers: list[Sequence]) -> None:
        """Give each of `followers` a slot holding a copy of `seq`'s states (`Scheduler`'s forks: its prompt just
        computed, ordered after that prefill on the device's stream)."""
        if not followers:
            return
        for follower in followers:
            if follower in self.slot:
                raise RuntimeError(f"fork: sequence {follower.seq_id} holds a state slot already; this is a bug")
            self.slot[follower] = self._take()
        src = torch.full((len(followers),), self.slot[seq], dtype=torch.long, device=self.conv.device)
        dst = torch.tensor([self.slot[f] for f in followers], dtype=torch.long, device=self.conv.device)
        for states in (self.conv, self.recurrent):
            states.index_copy_(1, dst, states.index_select(1, src))

    def release(self, seq: Sequence) -> None:
        slot = self.slot.pop(seq, None)
        if slot is not None:
            self.free.append(slot)

    def step(self, seqs: list[Sequence], lengths: list[int]) -> "LinearStep":
        """The states of a step that runs `lengths[i]` new tokens of `seqs[i]`, packed in that order. `fresh` when
        no sequence of it holds a slot yet (every one starts from zero states: a prompt's first chunk, a preempted
        sequence computed again; not a fork or a parked turn's continuation, which hold theirs before their step)."""
        device = self.conv.device
        fresh = not any(seq in self.slot for seq in seqs)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        index = torch.tensor(self.slots(seqs), dtype=torch.long, device=device)
        return LinearStep(self, index, cu, max(lengths), fresh=fresh)

    def decode_step(self, index: torch.Tensor) -> "LinearStep":
        """The states of a decode graph's step: one token per row, `index` (B,) int64 the rows' slots, a static
        buffer on the device (padding rows at `scratch_slot`). Nothing in it is read on the host."""
        cu = torch.arange(index.shape[0] + 1, dtype=torch.int32, device=index.device)
        return LinearStep(self, index, cu, 1)


class LinearStep:
    """One step's view of the cache: what `lathe.models.qwen3_5.HybridDecoderLayer` reads and writes. `layer`
    counts the linear layers as they run (in a decode graph, only while it is captured: module doc)."""

    def __init__(self, cache: LinearStateCache, index: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                 fresh: bool = False):
        self.cache, self.index, self.cu_seqlens, self.max_seqlen = cache, index, cu_seqlens, max_seqlen
        self.fresh = fresh
        self.layer = 0

    @torch.compiler.disable
    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(convolution inputs, recurrent states) of the step's sequences at the next linear layer; (None, None) in a
        `fresh` step, whose sequences all start from zero states: the layers then run the forms without given states
        (on CUDA fla's convolution and scans as a training forward runs them: the torch form of the convolution is
        what takes given inputs, and fla compiles its kernels with given states as a variant of their own)."""
        if self.fresh:
            return None, None
        c = self.cache
        return c.conv[self.layer].index_select(0, self.index), c.recurrent[self.layer].index_select(0, self.index)

    @torch.compiler.disable
    def write(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        c = self.cache
        c.conv[self.layer].index_copy_(0, self.index, conv.to(c.conv.dtype))
        c.recurrent[self.layer].index_copy_(0, self.index, recurrent.float())
        self.layer += 1

    # A step of one token per sequence (`GatedDeltaNet.step`): the layer hands over its inputs, the states advance
    # in their slots.

    @torch.compiler.disable
    def conv_step(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(conv + bias) (B, C) of each row's new input x after its slot's last K-1 inputs, which move on by one
        (on CUDA in place, one launch: `triton_gdn`)."""
        conv = self.cache.conv[self.layer]
        if triton_gdn.available(x.device):
            return triton_gdn.conv_step_(x, weight, conv, self.index, bias)
        out, window = conv_step(x, weight, conv.index_select(0, self.index), bias)
        conv.index_copy_(0, self.index, window.to(conv.dtype))
        return out

    @torch.compiler.disable
    def recurrent_step(self, q, k, v, g, beta) -> torch.Tensor:
        """o (B, Hv, Dv) of each row's token, its recurrent state advanced in its slot (on CUDA in place, one launch:
        `triton_gdn`); then on to the next linear layer."""
        states = self.cache.recurrent[self.layer]
        if triton_gdn.available(q.device):
            o = triton_gdn.gated_delta_step_(q, k, v, g, beta, states, self.index)
        else:
            o, final = recurrent_gated_delta_rule(*(t.unsqueeze(1) for t in (q, k, v, g, beta)),
                                                  states.index_select(0, self.index))
            states.index_copy_(0, self.index, final.float())
            o = o.squeeze(1)
        self.layer += 1
        return o

    @torch.compiler.disable
    def scan_step(self, x, dt, A, B, C, D) -> torch.Tensor:
        """y (B, H, P) of each row's token through a Mamba2 layer's scan (`lathe.models.ssd.scan_step`), its state
        advanced in its slot (on CUDA in place, one launch: `triton_ssd`); then on to the next linear layer."""
        states = self.cache.recurrent[self.layer]
        if triton_ssd.available(x.device):
            y = triton_ssd.scan_step_(x, dt, A, B, C, D, states, self.index)
        else:
            y, new = scan_step(x, dt, A, B, C, states.index_select(0, self.index), D=D)
            states.index_copy_(0, self.index, new)
        self.layer += 1
        return y


PARK_MODULUS = (1 << 61) - 1      # the parked sequences' token keys: a polynomial hash, checked token by token on a hit


def prefix_hashes(seq: Sequence) -> list[int]:
    """h[i] = the parked sequences' key of `seq.token_ids[:i + 1]` (a polynomial hash) for every i, memoised on the
    sequence with the tokens it was computed from (a list comparison is cheap beside the hashing): a waiting prompt is looked up at each admission
    check (`can_allocate`, `admits`, `allocate`), three Python passes over a conversation of thousands of tokens per
    admitted turn before."""
    ids, memo = seq.park_hashes
    if ids != seq.token_ids:
        ids, memo, h = list(seq.token_ids), [], 0
        for token in ids:
            h = (h * 1_000_003 + token + 1) % PARK_MODULUS
            memo.append(h)
        seq.park_hashes = (ids, memo)
    return memo


class StateBlockManager(BlockManager):
    """The block manager of a hybrid model: freeing a sequence's blocks gives its state slot back too.

    Without prefix caching, a conversation's next turn (the agent loop: its prompt is the finished turn's tokens and
    more) would compute the whole conversation again. So a finished streamed sequence (`Sequence.parkable`) is
    parked instead: it keeps its blocks up to the tokens its KV and states have taken in (`Sequence.num_fed`) and
    its state slot, and a later sequence whose tokens continue those takes them over (`allocate`) and computes only
    the rest. Parked sequences give way, least recently parked first, wherever blocks or slots are wanted
    (`make_room`, `evict_one`: admission, decode, a new slot), and all go at `reset` (weight loads, sleep)."""

    def __init__(self, *args, states: LinearStateCache, **kwargs):
        self.parked: OrderedDict[Sequence, tuple[int, int]] = OrderedDict()     # least recently parked first
        self.by_key: dict[tuple[int, int], Sequence] = {}                       # (tokens taken in, their hash)
        self.states = states
        super().__init__(*args, **kwargs)
        states.reclaim = self.evict_one

    def reset(self) -> None:
        for seq in self.parked:          # (their blocks are freed with every other by the reset below)
            seq.block_table = []
            self.states.release(seq)
        self.parked.clear()
        self.by_key.clear()
        super().reset()

    @property
    def holds_cache(self) -> bool:
        return bool(self.parked) or super().holds_cache

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        self.states.release(seq)

    def fork(self, seq: Sequence, followers: list[Sequence]) -> None:
        super().fork(seq, followers)
        self.states.fork(seq, followers)

    def release_finished(self, seq: Sequence) -> None:
        """Park `seq` (class doc) when it is a streamed sequence that took tokens in and its state slot and blocks
        are its own where a continuation would write; else free them."""
        fed, table = seq.num_fed, seq.block_table
        keep = -(-fed // self.block_size)
        if not (seq.parkable and fed > 0 and seq in self.states.slot and 0 < keep <= len(table)
                and (fed % self.block_size == 0 or self.blocks[table[keep - 1]].ref_count == 1)):
            self.deallocate(seq)
            return
        self._drop_refs(table[keep:])           # blocks past what it took in (a slot reserved for a dropped token)
        del table[keep:]
        key = (fed, prefix_hashes(seq)[fed - 1], _salt(seq))       # (an image prompt's: its images' digest too)
        if key in self.by_key:                  # the same tokens parked before: keep the newer
            self._evict(self.by_key[key])
        self.parked[seq] = key
        self.by_key[key] = seq

    def _evict(self, seq: Sequence) -> None:
        del self.by_key[self.parked.pop(seq)]
        self.deallocate(seq)

    def evict_one(self) -> bool:
        if not self.parked:
            return False
        self._evict(next(iter(self.parked)))
        return True

    def make_room(self, blocks: int, keep: Sequence | None = None) -> None:
        for seq in [s for s in self.parked if s is not keep]:
            if self.num_free_blocks >= blocks:
                return
            self._evict(seq)

    def continued(self, seq: Sequence) -> Sequence | None:
        """The parked sequence `seq` continues (the longest), if any: its taken-in tokens are the first of `seq`'s
        (and at least one of `seq`'s is left to compute, for its logits)."""
        if not seq.parkable or not self.parked:
            return None
        lengths = {fed for fed, _, _ in self.by_key if fed < len(seq)}
        if not lengths:
            return None
        hashes, salt = prefix_hashes(seq), _salt(seq)
        for fed in sorted(lengths, reverse=True):
            found = self.by_key.get((fed, hashes[fed - 1], salt))
            if found is not None and found.token_ids[:fed] == seq.token_ids[:fed]:
                return found
        return None

    def can_allocate(self, seq: Sequence) -> bool:
        return self.admits(seq, 0)

    def admits(self, seq: Sequence, extra: int) -> bool:
        """The blocks `seq` needs past a parked sequence it continues (kept from the room made for it)."""
        found = self.continued(seq)
        need = seq.num_blocks(self.block_size) - (len(found.block_table) if found is not None else 0)
        self.make_room(need + extra, keep=found)
        return self.num_free_blocks - need >= extra

    def allocate(self, seq: Sequence) -> None:
        """`BlockManager.allocate`, or, for a sequence that continues a parked one, its blocks and state slot taken
        over: only the tokens after those it took in are computed."""
        found = self.continued(seq)
        if found is None:
            super().allocate(seq)
            return
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        del self.by_key[self.parked.pop(found)]
        seq.block_table, found.block_table = found.block_table, []
        self.states.adopt(found, seq)
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._take_free().block_id)
        seq.num_kv_cached = seq.num_cached_tokens = found.num_fed
        if seq.num_deallocations == 0:
            seq.num_prefix_hit_tokens = found.num_fed
        seq.tail_private = False


STATE_SHARE = 0.3     # at most this share of a GPU's free memory goes to the linear-attention states ...
BUDGET_SHARE = 0.5    # ... and at most this share of the engine's budget (gpu_memory_utilization's): the rest is KV


def state_slots(cfg, max_num_seqs: int, dtype: torch.dtype, device: torch.device,
                utilization: float | None = None) -> int:
    """How many sequences may run at once: `max_num_seqs`, fewer on a GPU where their states would take more than
    `STATE_SHARE` of the free memory or, given the engine's `utilization` (`gpu_memory_utilization`), more than
    `BUDGET_SHARE` of what it leaves the engine beside the memory already allocated (the KV cache is sized from the
    same budget after the states: states that took it all would leave the cache one block). With a notice: each slot
    holds every linear layer's states (Nemotron-3-Nano's Mamba2 layers: 48 MiB a sequence in float32)."""
    if device.type != "cuda":
        return max_num_seqs
    from lathe import device as accel
    layers, conv_dim, kernel, recurrent = state_layout(cfg)
    per_slot = layers * (conv_dim * (kernel - 1) * torch.empty(0, dtype=dtype).element_size()
                         + 4 * math.prod(recurrent))
    free, total = accel.memory_info(device)
    room = STATE_SHARE * free
    if utilization is not None:
        room = min(room, BUDGET_SHARE * (total * utilization - accel.memory_allocated(device)))
    fits = max(1, int(room // per_slot) - 1)     # - the scratch slot
    if fits < max_num_seqs:
        log.info("engine: %s runs at most %d sequences at once (max_num_seqs=%d): each one's linear-attention states "
                 "take %.1f MiB (a larger rollout.gpu_memory_utilization runs more)", cfg.architecture, fits,
                 max_num_seqs, per_slot / 2**20)
    return min(fits, max_num_seqs)


def kv_layers(cfg) -> int:
    """How many layers keep paged KV: the full-attention ones of a hybrid model (or Nemotron-H), else all."""
    la, nemotron = getattr(cfg, "linear_attention", None), getattr(cfg, "nemotron", None)
    if nemotron is not None:
        return len(nemotron.layers("full_attention"))
    return cfg.num_hidden_layers if la is None else sum(t == "full_attention" for t in la.layer_types)


def has_states(cfg) -> bool:
    """Whether the model keeps per-sequence states in linear layers (`LinearStateCache`): the hybrids, Nemotron-H."""
    return getattr(cfg, "linear_attention", None) is not None or getattr(cfg, "nemotron", None) is not None


def state_layout(cfg) -> tuple[int, int, int, tuple[int, ...]]:
    """(linear layers, convolution channels, convolution kernel K, one slot's recurrent state shape) of a model with
    states: gated DeltaNet's (Hv, Dk, Dv), Mamba2's (H, P, N)."""
    nemotron = getattr(cfg, "nemotron", None)
    if nemotron is not None:
        m = nemotron.mamba
        return len(nemotron.layers("linear_attention")), m.conv_dim, m.conv_kernel, (m.num_heads, m.head_dim,
                                                                                     m.state_size)
    la = cfg.linear_attention
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    return (sum(t == "linear_attention" for t in la.layer_types), conv_dim, la.conv_kernel,
            (la.num_value_heads, la.key_head_dim, la.value_head_dim))


def hybrid_settings(model, enable_prefix_caching: bool, fuse_projections: bool | None,
                    quantization: str | None = None) -> tuple[bool, bool]:
    """(enable_prefix_caching, fuse_projections) for a hybrid model: both off (module doc; fused projections are not
    built for its layers), with a notice for prefix caching asked for; fused projections and FP8 refused."""
    arch = model.config.architecture        # (a VL model's: the checkpoint's, Qwen3_5ForConditionalGeneration)
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} (rollout.quantization): lathe's FP8 engine layers are not "
                         f"built for {arch}'s hybrid layers yet. Fix: leave rollout.quantization unset")
    if enable_prefix_caching:
        log.info("engine: prefix caching is off for %s (its linear-attention states are not cached at block "
                 "boundaries yet; rollout.enable_prefix_caching has no effect for it; a prompt's n samples still "
                 "prefill it once: they fork from the first)", arch)
    if fuse_projections:
        raise ValueError(f"fuse_projections=True: not implemented for {arch}'s hybrid layers")
    return False, False
