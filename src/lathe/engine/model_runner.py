"""Runs a `LatheCausalLM` over the paged KV cache: ragged prefill and batched decode.

The decoder's own modules do all the math (`model.model(input_ids, position_ids, attn)` with
embeddings, RoPE, norms, projections, MLP; for a VL model its language model, with 3D positions and the image
embeddings spliced at their placeholders: `multimodal.py`), so the engine and the trainer compute the same numbers;
only the attention callable differs. It is called once per layer, in order, and counts the layers to
know which cache to write and read.

Prefill sorts its sequences into three groups, each with the cheapest correct attention:
- fresh (nothing cached): packed causal attention over their own new tokens (flash `varlen_attn` on
  CUDA, per-sequence SDPA on CPU), exactly the trainer's packed path;
- one new token over a cached prefix (the n-1 other samples of a prompt): the decode kernel;
- several new tokens over a cached prefix (a prefix shared across prompts, a chunk of a long prompt, the agent
  loop's next turn): one masked SDPA over the group's gathered contexts (`CachedPrefill`).
Decode runs every sequence's last token; on CUDA it replays a CUDA graph captured for the smallest
batch bucket that holds the batch (`cuda_graph.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from lathe.device import multiprocessor_count, to_device
from lathe.engine import triton_store
from lathe.engine.kv_cache import KVCache
from lathe.engine.multimodal import StepInputs, hidden_states, is_vl, text_config
from lathe.engine.paged_attention import CachedPrefill, choose_decode_backend, decode_with
from lathe.engine.sequence import PENDING, Sequence
from lathe.models.attention import PackedAttention, select_packed_backend
from lathe.models.rope import apply_rotary


def rope_delta(seq: Sequence) -> int:
    """How far a generated token's rotary position is from its index (an image prompt's `rope_delta`; 0 for text)."""
    return 0 if seq.mm is None else seq.mm.delta


def step_split_k(model, rows: int, prefill: bool = False) -> tuple[int, int] | None:
    """The (o_proj, down_proj) K splits of an engine step of `rows` tokens (`DecoderLayer.split_forward`): a decode
    step's sequences, or a prefill step's new tokens (`prefill`), which always get (1, 1): the split form without
    splits, whose residual adds fold into the norms instead of cuBLAS addmm's copies; or None for the layers' plain
    forward. The split form pays where its adds fold into the norms, and it was measured on CUDA: only for lathe's
    text decoder compiled (`compile_decoder`, as the engine does on CUDA), in half precision, on CUDA.

    Why no K splits at prefill: each split pair is a compiled variant of the layers. The decode graphs' capture
    compiles the decode steps' pairs at start-up; a prefill of a few hundred tokens (prompts found in the prefix
    cache, a small admission) would compile one of its own the first time it met it, for a few percent of one step's
    layers: on an H100 the fixed load's 256-token prefill of cached prompts took 1.6 s (0.5B) and 2.3 s (1.5B) with
    its split pair, 0.025 and 0.043 s without (bench/results/rollout_prefill_no_split_ab_*)."""
    from lathe.models.decoder import LatheDecoderModel
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, LatheDecoderModel) or decoder.compile_backend is None or model.dtype == torch.float32:
        return None
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda":
        return None
    if prefill:
        return (1, 1)
    cfg, sms = model.config, multiprocessor_count(device)
    return (_splits_for(rows, cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, sms),
            _splits_for(rows, cfg.intermediate_size, cfg.hidden_size, sms))


def _splits_for(rows: int, k: int, n: int, num_sms: int) -> int:
    """K splits of a decode projection of `k` input and `n` output features at `rows` rows, as measured on an H100
    (bench/decode_split_layers.py, the layers' step time without attention): none under 192 rows (cuBLAS's own
    choice is as fast or faster); 4 where the output has fewer 64x64 tiles than the GPU has SMs, 2 where it has up
    to twice as many, none beyond (7B's down projection at 512 rows, 448 tiles: 2 splits 3% slower than 1); never
    chunks under 2048 features (0.5B's down projection, K=4864: 2 splits 5% faster at 256 rows, 4 slower than 1)."""
    if rows < 192:
        return 1
    tiles = -(-rows // 64) * -(-n // 64)
    for s in ((4, 2) if tiles < num_sms else (2,) if tiles < 2 * num_sms else ()):
        if k % s == 0 and k // s >= 2048:
            return s
    return 1


@dataclass
class DecodeAttention:
    """One token per sequence: store its K/V at `slot_mapping`, attend over the blocks. No host syncs, so it
    can run under CUDA-graph capture."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor      # (B,) int64, every slot valid (padding rows write the scratch slot)
    block_tables: torch.Tensor      # (B, max_blocks) int32
    context_lens: torch.Tensor      # (B,) int32
    backend: str = "torch"
    num_splits: int = 1
    # whether the layers hand this attention q and k before RoPE, with cos/sin (`DecoderLayer`); on CUDA by default:
    # one Triton launch then rotates q and k and stores k and v (`triton_store.rope_store_kv`); with the Triton decode
    # kernel that launch is the attention's own (`triton_decode.paged_decode(new_kv=...)`)
    rotates: bool | None = None
    # (o_proj, down_proj) K splits of the decoder's split-K decode form (`DecoderLayer.split_forward`), or None: the
    # layers' plain forward (`step_split_k` picks them)
    split_k: tuple[int, int] | None = None
    # the step's RoPE rows (cos, sin), each (B, head_dim), when the caller has them (the decode graph's table lookup,
    # `triton_step.step_inputs`); None: the model computes them from the positions
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # launch the Triton kernel as a programmatic dependent of the q/k/v projection before it (`paged_decode(pdl=True)`):
    # only where the context lengths, slots and RoPE rows were written at the step's start (`step_inputs`), not by
    # the launch right before the attention
    pdl: bool = False

    def __post_init__(self):
        if self.rotates is None:
            self.rotates = self.kv_cache.device.type == "cuda" and triton_store.triton is not None
        self.layer = 0
        self.counters = None        # the split kernel's merge counters, one zeroed set shared by the step's layers
        if self.backend == "triton" and self.num_splits > 1:
            rows, kv_heads = self.block_tables.shape[0], self.kv_cache.k[0].shape[2]
            self.counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device=self.block_tables.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        self.layer += 1
        in_launch = cos is not None and triton_store.can_rope_store(q, k, v, cos, sin)
        if in_launch and self.backend == "triton":
            from lathe.engine.triton_decode import paged_decode      # RoPE, store and attention in one launch
            return paged_decode(q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.block_tables,
                                self.context_lens, num_splits=self.num_splits, counters=self.counters,
                                new_kv=(k, v, cos, sin, self.slot_mapping), pdl=self.pdl)
        if in_launch:
            q = triton_store.rope_store_kv(q, k, v, cos, sin, self.kv_cache.k[layer], self.kv_cache.v[layer],
                                           self.slot_mapping)
        else:
            if cos is not None:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            self.kv_cache.store_unchecked(layer, k, v, self.slot_mapping)
        return decode_with(self.backend, q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.block_tables,
                           self.context_lens, self.num_splits, self.counters)


@dataclass
class PrefillAttention:
    """New tokens laid out as [fresh sequences | single new tokens | the rest]; see the module docstring."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor      # slots of the new tokens whose KV is not cached yet (rows `store_rows`)
    num_fresh_tokens: int
    fresh: PackedAttention | None
    single: tuple[torch.Tensor, torch.Tensor] | None     # (block_tables, context_lens) of the single-token group
    rest: tuple[list[int], list[int], list[list[int]]]   # (cu_seqlens_q from the group's start, ctx lens, tables)
    decode_backend: str = "torch"
    store_rows: torch.Tensor | None = None     # rows of the new tokens to store (None: all of them)
    split_k: tuple[int, int] | None = None     # the layers' split form (`step_split_k`), or None: their plain forward

    def __post_init__(self):
        self.layer = 0
        self._cached = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        self.layer += 1
        if self.store_rows is None:
            self.kv_cache.store_unchecked(layer, k, v, self.slot_mapping)
        else:       # picked by rows known on the host: a boolean mask would make the host wait for the device
            self.kv_cache.store_unchecked(layer, k.index_select(0, self.store_rows),
                                          v.index_select(0, self.store_rows), self.slot_mapping)
        kc, vc = self.kv_cache.k[layer], self.kv_cache.v[layer]
        a = self.num_fresh_tokens
        b = a + (0 if self.single is None else self.single[1].shape[0])
        outs = []
        if self.fresh is not None:
            outs.append(self.fresh(q[:a], k[:a], v[:a]))
        if self.single is not None:
            outs.append(decode_with(self.decode_backend, q[a:b], kc, vc, *self.single))
        cu, ctx, tables = self.rest
        if ctx:
            if self._cached is None:                # built once, used by every layer
                self._cached = CachedPrefill(cu, ctx, tables, q.device)
            outs.append(self._cached(q[b:], kc, vc))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, *, max_model_len: int, decode_backend: str = "auto",
                 cuda_graphs: bool = True, max_graph_batch: int = 512):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        cfg = text_config(model)
        self.vl = is_vl(model)                      # image prompts: 3D positions, image rows spliced at prefill
        self.decode_backend, self.backend_times = choose_decode_backend(
            decode_backend, self.device, model.dtype, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, block_size=self.block_size)
        self.packed_backend = select_packed_backend("auto", self.device, model.dtype)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and cfg.rope.rope_type != "dynamic":
            from lathe.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_graph_batch)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """KV slots of `seq`'s positions start..end-1, -1 for those whose KV is cached already (computed with numpy:
        a per-token Python loop took ~5 ms of an 8k-token prefill step's host time)."""
        bs = self.block_size
        pos = np.arange(start, end, dtype=np.int64)
        slots = np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
        slots[:max(0, seq.num_kv_cached - start)] = -1
        return slots

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        """A list or numpy array on the device (a numpy array of `dtype` without a host copy)."""
        return to_device(torch.as_tensor(data, dtype=dtype), self.device)

    def _tables(self, seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
        """(len(seqs), width) int32 block tables padded with block 0; width = the longest table by default."""
        tables = [s.block_table for s in seqs]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        width = int(lens.max()) if width is None else width
        out = np.zeros((len(tables), width), dtype=np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
        rows = np.repeat(np.arange(len(tables)), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        out[rows, cols] = flat
        return torch.from_numpy(out)

    # ---- prefill -------------------------------------------------------------------------------------
    def prepare_prefill(self, seqs: list[Sequence], num_new: list[int]):
        """Inputs for sequence i's tokens `num_cached_tokens ... + num_new[i]`, grouped (see module doc).

        Returns (ids, positions, attn, last, order, visual): `last[j]` is the row of group-ordered sequence
        `order[j]`'s last new token; a VL model's positions are 3D (3, T) and `visual` holds the image rows its
        tokens take (`multimodal.StepInputs`), None otherwise.
        """
        def group(i):
            seq = seqs[i]
            return 0 if seq.num_cached_tokens == 0 else (1 if num_new[i] == 1 else 2)
        order = sorted(range(len(seqs)), key=group)
        groups = [group(i) for i in order]
        id_parts, pos_parts, slot_parts, cu = [], [], [], [0]
        step = StepInputs() if self.vl else None
        for i in order:
            seq, start = seqs[i], seqs[i].num_cached_tokens
            end = start + num_new[i]
            id_parts.append(seq.token_ids[start:end])
            pos_parts.append(np.arange(start, end, dtype=np.int64))
            if step is not None:
                step.add(seq.mm, start, end)
            slot_parts.append(self._slots(seq, start, end))
            cu.append(cu[-1] + end - start)
        # numpy, not Python lists, on the way to the device: torch.tensor of an 8k-token list took ~0.5 ms a call
        ids = np.fromiter(itertools.chain.from_iterable(id_parts), dtype=np.int64, count=cu[-1])
        positions = np.concatenate(pos_parts) if pos_parts else np.zeros(0, dtype=np.int64)
        if (ids == PENDING).any():
            raise RuntimeError("engine: a prefill met a token still on the device; this is a bug (a sequence's "
                               "pending token must be resolved before it is prefilled again)")
        n_fresh, n_single = groups.count(0), groups.count(1)
        fresh = None
        if n_fresh:
            lens = [cu[j + 1] - cu[j] for j in range(n_fresh)]
            fresh = PackedAttention(self._tensor(cu[:n_fresh + 1], torch.int32), max(lens), self.packed_backend)
        single = None
        if n_single:
            members = [seqs[i] for i in order[n_fresh:n_fresh + n_single]]
            single = (to_device(self._tables(members), self.device),
                      self._tensor([s.num_cached_tokens + 1 for s in members], torch.int32))
        rest_idx = range(n_fresh + n_single, len(order))
        base = cu[n_fresh + n_single]
        rest = ([cu[j] - base for j in rest_idx] + [cu[-1] - base] if rest_idx else [],
                [seqs[order[j]].num_cached_tokens + num_new[order[j]] for j in rest_idx],
                [seqs[order[j]].block_table for j in rest_idx])
        slots = np.concatenate(slot_parts) if slot_parts else np.zeros(0, dtype=np.int64)
        rows = np.flatnonzero(slots >= 0)                          # -1: the KV is cached already
        store_rows = None
        if len(rows) < len(slots):
            store_rows, slots = self._tensor(rows), slots[rows]
        attn = PrefillAttention(self.kv_cache, self._tensor(slots), cu[n_fresh], fresh, single, rest,
                                self.decode_backend, store_rows, step_split_k(self.model, len(ids), prefill=True))
        last = self._tensor(cu[1:]) - 1
        if step is None:
            return self._tensor(ids), self._tensor(positions), attn, last, order, None
        pos3, mask, rows, deep = step.build(self.device)
        return self._tensor(ids), pos3, attn, last, order, (mask, rows, deep)

    # ---- decode --------------------------------------------------------------------------------------
    def decode_inputs(self, seqs: list[Sequence]):
        """Host-side (ids, positions, slots, context lens) lists of a decode step."""
        bs = self.block_size
        lens = [len(s.token_ids) for s in seqs]
        ids = [s.token_ids[-1] for s in seqs]
        positions = [n - 1 for n in lens]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        return ids, positions, slots, lens

    # ---- run -----------------------------------------------------------------------------------------
    @staticmethod
    def take_pending(ids: torch.Tensor, pending: tuple | None) -> None:
        """Write the input ids that are still on the device: `pending = (tokens, rows, src)` sets
        `ids[rows[j]] = tokens[src[j]]` (the previous step's samples, which the host has not seen yet);
        `(tokens, None, n)`: the first n rows are the previous step's first n."""
        if not pending:
            return
        tokens, rows, src = pending
        if rows is None:
            ids[:src].copy_(tokens[:src])
            return
        index = to_device(torch.tensor([rows, src]), ids.device)
        ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], num_new: list[int] | None = None) -> torch.Tensor:
        """Logits (B, V), in the model's dtype, for the next token of each sequence (rows in `seqs` order), after
        computing `num_new[i]` tokens of sequence i (all its uncached tokens by default)."""
        if num_new is None:
            num_new = [len(s) - s.num_cached_tokens for s in seqs]
        ids, positions, attn, last, order, visual = self.prepare_prefill(seqs, num_new)
        hidden = hidden_states(self.model, ids, positions, attn, visual)[last]
        inverse = [0] * len(order)
        for j, i in enumerate(order):
            inverse[i] = j
        return self.model.lm_head(hidden[self._tensor(inverse)])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], pending: tuple | None = None, sampling=None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step: (logits (B, V), sampled (2, B) float64 token ids and log-probs, or None).

        On CUDA graphs the step samples too when `sampling` (`sampler.fused_settings` of the batch) is given;
        otherwise `sampled` is None and the caller samples from the logits."""
        if self.graphs is not None and self.graphs.fits(len(seqs)):
            return self.graphs.run(seqs, pending, sampling)
        ids, positions, slots, lens = self.decode_inputs(seqs)
        attn = DecodeAttention(self.kv_cache, self._tensor(slots), to_device(self._tables(seqs), self.device),
                               self._tensor(lens, torch.int32), self.decode_backend,
                               split_k=step_split_k(self.model, len(seqs)))
        ids = self._tensor(ids)
        self.take_pending(ids, pending)
        rope = positions if not self.vl else [p + rope_delta(s) for s, p in zip(seqs, positions)]
        return self.model.lm_head(hidden_states(self.model, ids, self._tensor(rope), attn)), None
