"""Runs a `LatheCausalLM` over the paged KV cache: ragged prefill and batched decode.

The decoder's own modules do all the math (`model.model(input_ids, position_ids, attn)` with
embeddings, RoPE, norms, projections, MLP), so the engine and the trainer compute the same numbers;
only the attention callable differs. It is called once per layer, in order, and counts the layers to
know which cache to write and read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.engine.kv_cache import KVCache
from lathe.engine.paged_attention import decode_attention, prefill_attention
from lathe.engine.sequence import Sequence


@dataclass
class PagedAttention:
    """The `attn(q, k, v)` callable the decoder layers call: store the new K/V, attend over the cache."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor              # (T,) slot of each new token, -1 = already cached
    is_prefill: bool
    context_lens: list[int]
    block_tables: list[list[int]]
    cu_seqlens_q: list[int] | None = None   # prefill only

    def __post_init__(self):
        self.layer = 0
        if not self.is_prefill:
            device = self.slot_mapping.device
            width = max(len(t) for t in self.block_tables)
            self._tables = torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables], device=device)
            self._lens = torch.tensor(self.context_lens, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        self.layer += 1
        self.kv_cache.store(layer, k, v, self.slot_mapping)
        kc, vc = self.kv_cache.k[layer], self.kv_cache.v[layer]
        if self.is_prefill:
            return prefill_attention(q, kc, vc, self.cu_seqlens_q, self.context_lens, self.block_tables)
        return decode_attention(q, kc, vc, self._tables, self._lens)


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]):
        """Flattened new tokens of every sequence (those past its cached prefix) and their attention context."""
        ids, positions, slots, cu = [], [], [], [0]
        for seq in seqs:
            start = seq.num_cached_tokens
            ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            slots.extend(self._slot(seq, p) if p >= seq.num_kv_cached else -1 for p in range(start, len(seq)))
            cu.append(len(ids))
        dev = self.device
        attn = PagedAttention(self.kv_cache, torch.tensor(slots, device=dev), True, [len(s) for s in seqs],
                              [s.block_table for s in seqs], cu)
        last = torch.tensor(cu[1:], device=dev) - 1
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attn, last

    def prepare_decode(self, seqs: list[Sequence]):
        """The last token of every sequence, at position len - 1."""
        dev = self.device
        ids = torch.tensor([s.last_token for s in seqs], device=dev)
        positions = torch.tensor([len(s) - 1 for s in seqs], device=dev)
        slots = torch.tensor([self._slot(s, len(s) - 1) for s in seqs], device=dev)
        attn = PagedAttention(self.kv_cache, slots, False, [len(s) for s in seqs], [s.block_table for s in seqs])
        return ids, positions, attn, None

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits (B, V) in float32 for the next token of each sequence."""
        ids, positions, attn, last = (self.prepare_prefill if is_prefill else self.prepare_decode)(seqs)
        hidden = self.model.model(ids, positions, attn)
        if last is not None:
            hidden = hidden[last]
        return self.model.lm_head(hidden).float()
