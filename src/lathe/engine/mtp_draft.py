"""The draft model of speculative decoding: the policy's first MTP layer (`lathe.models.mtp`) over a paged KV cache.

MTP layer 0 at position t reads the main model's final hidden state h_t and the embedding of token t+1, and its output
(through the shared `lm_head`) predicts token t+2. Drafting, as SGLang's EAGLE runs an MTP model (`speculative_num_steps`
steps, `speculative_eagle_topk=1`) and vLLM's `method=mtp`: the first draft d_1 comes from the layer at the position
before the last committed token (h of that position from the last target forward, the last committed token's
embedding); draft j+1 runs the same layer one position on, on draft j's embedding and the layer's own previous output
in place of the main model's hidden state (which the drafts do not have). Only the first MTP layer drafts (SGLang's
MTP draft model is one layer run `num_steps` times); a checkpoint's further MTP layers are trained but not read here.

The layer's attention needs its own keys and values at every earlier position, so it has a one-layer paged cache of
its own (`cache`), addressed through the sequences' block tables. Its entry for position s is stored in the slot of
position s + 1 (the slot of token s + 1, the token it reads): it is a function of tokens 0..s+1 only, so a block keyed
by its tokens (prefix caching) holds the right entries whoever computed them, like the main cache. Slot 0 holds none
and the attention masks it (`ShiftedPrefill`). Entries are written when their token is committed (after a prefill
chunk, and at the start of each verify step for the tokens the last one accepted); the draft chain's own entries,
past the committed tokens, are overwritten when those positions are committed.
"""

from __future__ import annotations

import numpy as np
import torch

from lathe.device import to_device
from lathe.engine.kv_cache import KVCache
from lathe.engine.paged_attention import CachedPrefill
from lathe.engine.sequence import Sequence


class ShiftedPrefill(CachedPrefill):
    """`CachedPrefill` whose queries never see slot 0 (the MTP cache's unused slot, module doc); padded query rows
    keep that one key, as in `CachedPrefill`, so their (dropped) outputs stay finite."""

    def __init__(self, cu_seqlens_q: list[int], context_lens: list[int], block_tables: list[list[int]],
                 device: torch.device):
        super().__init__(cu_seqlens_q, context_lens, block_tables, device)
        n = torch.tensor([cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(context_lens))], device=device)
        self.mask[:, 0, :, 0] = torch.arange(self.max_new, device=device)[None, :] >= n[:, None]


class MtpAttention:
    """The MTP layer's attention callable (`lathe.models.attention.AttentionFn`) for one call: store the new keys and
    values at `slots` of the MTP cache, attend causally over each sequence's entries."""

    rotates = False
    rope = None
    split_k = None
    layer_options = True

    def __init__(self, cache: KVCache, slots: torch.Tensor, attention: ShiftedPrefill):
        self.cache, self.slots, self.attention = cache, slots, attention

    def __call__(self, q, k, v, *, sinks=None, window=None):
        self.cache.store_unchecked(0, k, v, self.slots)
        return self.attention(q, self.cache.k[0], self.cache.v[0], sinks=sinks, window=window)


class MtpDrafter:
    """MTP layer 0 of `model` and its paged cache (`num_blocks` blocks of `block_size`, as the main cache)."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model, self.layer = model, model.model.mtp_layers[0]
        attn = self.layer.self_attn         # (a tensor-parallel replica's MTP layer is whole: all the heads)
        self.cache = KVCache(1, num_blocks, block_size, attn.n_kv, attn.head_dim, dtype=model.dtype,
                             device=model.device)

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        attn = model.model.mtp_layers[0].self_attn
        return KVCache.bytes_per_block(1, block_size, attn.n_kv, attn.head_dim, model.dtype)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], starts: list[int], hidden: torch.Tensor, tokens: list[list[int]]
            ) -> torch.Tensor:
        """The layer's outputs (T, H) at positions `starts[i] .. starts[i] + len(tokens[i]) - 1` of sequence i (rows
        laid end to end in `seqs` order): `hidden` (T, H) the hidden states it reads there, `tokens[i]` the tokens
        after those positions. Stores the entries (slots of positions + 1; module doc)."""
        inner, bs = self.model.model, self.cache.block_size
        counts = [len(t) for t in tokens]
        cu = np.concatenate([[0], np.cumsum(counts)]).tolist()
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts)])
        slots = np.concatenate([np.asarray(s.block_table, dtype=np.int64)[(positions[cu[i]:cu[i + 1]] + 1) // bs] * bs
                                + (positions[cu[i]:cu[i + 1]] + 1) % bs for i, s in enumerate(seqs)])
        device = hidden.device
        attention = ShiftedPrefill(cu, [a + n + 1 for a, n in zip(starts, counts)], [s.block_table for s in seqs],
                                   device)
        attn = MtpAttention(self.cache, to_device(torch.from_numpy(slots), device), attention)
        ids = to_device(torch.tensor([t for part in tokens for t in part], dtype=torch.int64), device)
        pos = to_device(torch.from_numpy(positions), device)
        cos, sin = inner.rotary_emb(pos, hidden.dtype)
        return self.layer(hidden, inner.embed_tokens(ids), cos, sin, attn)

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The draft tokens (argmax of the shared `lm_head`) of MTP outputs (N, H)."""
        return self.model.lm_head(out).argmax(-1)
