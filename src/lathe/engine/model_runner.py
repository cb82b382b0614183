"""Runs a `LatheCausalLM` over the paged KV cache: ragged prefill and batched decode.

The decoder's own modules do all the math (embeddings, RoPE, norms, projections, MLP; for a VL model its language
model, with 3D positions and the image embeddings spliced at their placeholders: `multimodal.py`), so the engine
and the trainer compute the same numbers; what differs is the attention callable (`step_attention.py`: called once
per layer, in order, it counts the layers to know which cache to write and read) and the forms the engine runs the
layers in (`decode_forms.py`: fused projections, split-K layers).

Prefill sorts its sequences into three groups, each with the cheapest correct attention:
- fresh (nothing cached): packed causal attention over their own new tokens (flash `varlen_attn` on
  CUDA, per-sequence SDPA on CPU), exactly the trainer's packed path;
- one new token over a cached prefix (the n-1 other samples of a prompt): the decode kernel;
- several new tokens over a cached prefix (a prefix shared across prompts, a chunk of a long prompt, the agent
  loop's next turn): one attention over the group's gathered contexts (`CachedPrefill`: flash `varlen_attn` over
  the packed contexts on CUDA, masked SDPA over a padded batch elsewhere).
Decode runs every sequence's last token; on CUDA it replays a CUDA graph captured for the smallest
batch bucket that holds the batch (`cuda_graph.py`), unless the model's MoE layers read per-expert counts on the
host (their expert loop, where the grouped matmul is not available: `lathe.models.moe.graph_capturable`, and the
fused decode experts below are not chosen), which a capture cannot hold: those models decode eagerly, and so does
the DeepSeek-V3 family's latent attention (`mla.py`). A MoE model's experts run in decode steps as two fused Triton
launches per layer (`triton_moe.py`) where a probe at start-up finds them faster than `experts_forward`; prefill
keeps `experts_forward`.
Attention sinks and sliding windows (GPT-OSS) are captured like the rest: each layer's window is a constant of the
capture and its sink logits a parameter, read at replay (checked on CUDA: `tests/engine/test_new_families_gpu.py`).
The hybrid families' decode steps are captured too: their linear-attention layers read and write the sequences'
states by a slot index that the graph's step takes from its static inputs (`linear_state.py`).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from lathe.device import to_device
from lathe.engine import decode_forms
from lathe.engine.cuda_graph import DecodeGraphs
from lathe.engine.kv_cache import KVCache
from lathe.engine.mla import cache_layout, is_mla
from lathe.engine.multimodal import StepInputs, hidden_states, rope_delta, text_config
from lathe.engine.paged_attention import choose_decode_backend
from lathe.engine.sequence import PENDING, Sequence
from lathe.engine.step_attention import DecodeAttention, PrefillAttention
from lathe.engine.triton_moe import choose_moe_backend, fusable_blocks, set_decode_experts
from lathe.models.attention import PackedAttention, select_packed_backend
from lathe.models.moe import graph_capturable
from lathe.models.vl import is_vl

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, *, max_model_len: int, decode_backend: str = "auto",
                 cuda_graphs: bool = True, max_graph_batch: int = 512, graph_sizes: list[int] | None = None,
                 states=None, shared_prefix: bool = True):
        self.model = model
        self.shared_prefix = shared_prefix      # decode graphs attend a shared prompt once per group (`cuda_graph`)
        self.states = states        # a hybrid model's linear-attention states (`linear_state.py`), or None
        # whether a decode step's attention rotates q and k (`DecodeAttention.rotates`): not for the hybrid and MLA
        # layers, which rotate them themselves, nor under RoPE over part of each head (GLM-4.5), which the attention's
        # one launch does not do (`triton_store.can_rope_store`)
        cfg = text_config(model)
        self.rotates = False if states is not None or is_mla(model) or cfg.rotary_dim != cfg.head_dim else None
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        self.vl = is_vl(model)                      # image prompts: 3D positions, image rows spliced at prefill
        kv_heads, width = cache_layout(cfg)         # (a DeepSeek-V3 model's latent: one "head", `mla.py`)
        self.decode_backend, self.backend_times = choose_decode_backend(
            decode_backend, self.device, model.dtype, num_heads=cfg.num_attention_heads,
            num_kv_heads=kv_heads, head_dim=width, block_size=self.block_size, kv_dtype=kv_cache.dtype)
        # (the latent's width is past flash attention's head sizes: SDPA)
        self.packed_backend = select_packed_backend("sdpa" if is_mla(model) else "auto", self.device, model.dtype)
        self.cached_backend = self.packed_backend   # `CachedPrefill`'s (bench/agent_rollout.py --padded-cached-prefill)
        # the MoE layers' experts in decode steps: the fused Triton kernels or `experts_forward`, the faster on a
        # probe (`triton_moe.choose_moe_backend`); prefill steps run `experts_forward` (`prefill`)
        self.moe_backend, self.moe_times = choose_moe_backend(model, max_graph_batch)
        self.fused_blocks = fusable_blocks(model) if self.moe_backend == "triton_fused" else []
        set_decode_experts(self.fused_blocks, True)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and cfg.rope.rope_type != "dynamic" \
                and (graph_capturable(model) or self.fused_blocks) and not is_mla(model):
            self.graphs = DecodeGraphs(self, max_graph_batch, graph_sizes)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """KV slots of `seq`'s positions start..end-1, -1 for those whose KV is cached already (computed with numpy:
        a per-token Python loop is a large share of a long prefill step's host time)."""
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
        # numpy, not Python lists, on the way to the device: torch.tensor of a long Python list is slow
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
                                self.decode_backend, store_rows,
                                decode_forms.step_split_k(self.model, len(ids), prefill=True),
                                cached_backend=self.cached_backend)
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
        hidden, last, order = self._prefill_forward(seqs, num_new)
        inverse = [0] * len(order)
        for j, i in enumerate(order):
            inverse[i] = j
        return self.model.lm_head(hidden[last][self._tensor(inverse)])

    def _prefill_forward(self, seqs: list[Sequence], num_new: list[int]):
        """(hidden states (T, H) of every new token in group order, `last`, `order`: see `prepare_prefill`)."""
        ids, positions, attn, last, order, visual = self.prepare_prefill(seqs, num_new)
        if self.states is not None:
            attn.linear_states = self.states.step([seqs[i] for i in order], [num_new[i] for i in order])
        set_decode_experts(self.fused_blocks, False)     # the fused experts are for decode sizes (tuned for them)
        try:
            return hidden_states(self.model, ids, positions, attn, visual), last, order
        finally:
            set_decode_experts(self.fused_blocks, True)

    @torch.inference_mode()
    def prefill_hidden(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Final hidden states (T, H) of every new token (a prefill step's or a speculative verify step's: sequence
        i's `num_new[i]` tokens from its `num_cached_tokens`), sequence i's rows after those of sequences 0..i-1."""
        hidden, _, order = self._prefill_forward(seqs, num_new)
        starts = np.cumsum([0] + [num_new[i] for i in order])
        where = {i: j for j, i in enumerate(order)}
        rows = np.concatenate([np.arange(starts[where[i]], starts[where[i] + 1]) for i in range(len(seqs))])
        return hidden[self._tensor(rows)]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], pending: tuple | None = None, sampling=None, *, eager: bool = False,
               agreed: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step: (logits (B, V), sampled (2, B) float64 token ids and log-probs, or None).

        On CUDA graphs the step samples too when `sampling` (`sampler.fused_settings` of the batch) is given;
        otherwise `sampled` is None and the caller samples from the logits. A data-parallel-attention engine's replicas
        agree on each step (`LatheEngine._dp_agree`): `eager`, or the graph `agreed`."""
        if self.graphs is not None and not eager and (agreed is not None or self.graphs.fits(len(seqs))):
            return self.graphs.run(seqs, pending, sampling, agreed)
        ids, positions, slots, lens = self.decode_inputs(seqs)
        attn = DecodeAttention(self.kv_cache, self._tensor(slots), to_device(self._tables(seqs), self.device),
                               self._tensor(lens, torch.int32), self.decode_backend,
                               split_k=decode_forms.step_split_k(self.model, len(seqs)), rotates=self.rotates)
        if self.states is not None:
            attn.linear_states = self.states.step(seqs, [1] * len(seqs))
        ids = self._tensor(ids)
        self.take_pending(ids, pending)
        rope = positions if not self.vl else [p + rope_delta(s) for s, p in zip(seqs, positions)]
        return self.model.lm_head(hidden_states(self.model, ids, self._tensor(rope), attn)), None
