"""The paged KV cache: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

A token's slot is `block_id * block_size + offset`; `store` writes new tokens' K/V to their slots
(slot -1 = already cached, skipped). One extra block past `num_blocks`, never handed out, holds
`scratch_slot`: padding rows of a CUDA-graph batch write there. `free()` drops the tensors (engine `sleep`), `allocate()` takes
them back (`wake_up`). All layers' K and V are views of one allocation, so that the cache comes back at the same
address when the allocator still holds that block (`address`): the engine's captured decode graphs, which hold
it, then stay valid across a sleep.
"""

from __future__ import annotations

import torch

from lathe.device import to_device
from lathe.engine.triton_store import can_store, store_kv


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)   # + the scratch block
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.buffer: torch.Tensor | None = None     # (2, layers, *shape): k[i] is buffer[0, i], v[i] buffer[1, i]
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return self.shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_size(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the cache takes when allocated (K and V, every layer, the scratch block included)."""
        return self.bytes_per_block(self.num_layers, *self.shape[1:], self.dtype) * self.shape[0]

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def address(self) -> tuple[int, tuple[int, ...]] | None:
        """Where the cache lives and its shape, or None when freed: equal addresses mean kernels captured against
        the one can run on the other."""
        return None if self.buffer is None else (self.buffer.data_ptr(), self.shape)

    def allocate(self) -> None:
        if self.allocated:
            return
        self.buffer = torch.zeros((2, self.num_layers) + self.shape, dtype=self.dtype, device=self.device)
        self.k, self.v = list(self.buffer[0].unbind(0)), list(self.buffer[1].unbind(0))

    def free(self) -> None:
        self.k, self.v, self.buffer = [], [], None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k/v (T, kv_heads, head_dim) to the slots `slot_mapping` (T,); slots < 0 are skipped."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        flat = (-1,) + self.shape[2:]
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))

    def store_unchecked(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """`store` for slots known to be valid: no host sync, so it can be captured in a CUDA graph. On CUDA one
        Triton launch writes both (`triton_store`)."""
        if can_store(k, v):
            store_kv(k, v, self.k[layer], self.v[layer], slot_mapping)
            return
        flat = (-1,) + self.shape[2:]
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared partial blocks)."""
        if not pairs:
            return
        src, dst = to_device(torch.tensor(pairs).T.contiguous(), self.device)
        for cache in self.k + self.v:
            cache[dst] = cache[src]
