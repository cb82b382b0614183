"""Routing replay's engine side: each token's MoE choices, recorded as its KV is written (verl's
`rollout.enable_rollout_routing_replay`).

Every MoE layer (`lathe.models.moe.SparseMoeBlock`) gets a `routing` hook that routes as usual and writes the token's
top-k experts to its KV slot in one preallocated (layers, slots, k) int16 buffer, with the very slot mapping the
step's attention stores K/V with (`hidden_states` hands the recorder the step's attention). So a prefix the block
manager shares carries its routing along, a copied block is copied here too, and a decode step captured in a CUDA
graph writes into the same buffer on every replay (its padding rows write the scratch slot). When a sequence
finishes, before its blocks are freed, its positions' choices are gathered on the device (`take`): the routing of
every token it fed (the prompt and every response token but the last, which no step computes; that row is -1).

The buffer is sized for the KV cache's first size (it never grows; `wake_up` may shrink it) and is kept across
`sleep`: (layers x k x 2 bytes) per KV slot, a small fraction of the slot's K/V.
"""

from __future__ import annotations

import numpy as np
import torch

from lathe.device import to_device
from lathe.models.moe import route, sparse_blocks

DTYPE = torch.int16


class RoutingRecorder:
    def __init__(self, model, kv_cache):
        self.blocks = sparse_blocks(model)
        if not self.blocks:
            raise ValueError("routing replay: the model has no mixture-of-experts layers to record")
        top_k = self.blocks[0].moe.num_experts_per_tok
        if self.blocks[0].moe.num_experts > torch.iinfo(DTYPE).max:
            raise ValueError(f"routing replay: {self.blocks[0].moe.num_experts} experts do not fit int16")
        self.block_size = kv_cache.block_size
        slots = (kv_cache.num_blocks + 1) * kv_cache.block_size       # + the scratch block
        self.buffer = torch.full((len(self.blocks), slots, top_k), -1, dtype=DTYPE, device=kv_cache.device)
        self.attn = None
        for i, block in enumerate(self.blocks):
            block.set_routing(_SlotWriter(self, i))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (the KV cache's copy-on-write)."""
        if not pairs:
            return
        src, dst = to_device(torch.tensor(pairs).T.contiguous(), self.buffer.device)
        view = self.buffer.view(self.buffer.shape[0], -1, self.block_size, self.buffer.shape[2])
        view[:, dst] = view[:, src]

    def take(self, seq) -> torch.Tensor:
        """(len(seq), layers, k) int16 on the device: the choices at each of `seq`'s positions, the last one -1 (and
        every position whose blocks it no longer holds)."""
        n, bs = len(seq.token_ids), self.block_size
        # (a sequence preempted while its last token was on the device ends holding no blocks: nothing to take)
        pos = np.arange(min(max(0, n - 1), len(seq.block_table) * bs), dtype=np.int64)
        slots = np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
        out = self.buffer.index_select(1, to_device(torch.from_numpy(slots), self.buffer.device))
        out = torch.cat([out, out.new_full((out.shape[0], n - len(pos), out.shape[2]), -1)], dim=1)
        return out.transpose(0, 1)


class _SlotWriter:
    """A layer's hook: its own top-k, written to the step's KV slots."""

    def __init__(self, recorder: RoutingRecorder, layer: int):
        self.recorder, self.layer = recorder, layer

    def __call__(self, probs: torch.Tensor, top_k: int, norm_topk_prob: bool, own=None, weigh=None):
        weights, chosen = own(probs) if own is not None else route(probs, top_k, norm_topk_prob)
        attn = self.recorder.attn
        if attn is not None:
            rows = getattr(attn, "store_rows", None)
            values = (chosen if rows is None else chosen.index_select(0, rows)).to(DTYPE)
            self.recorder.buffer[self.layer].index_copy_(0, attn.slot_mapping, values)
        return weights, chosen
