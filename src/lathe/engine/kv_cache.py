"""The paged KV cache: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

A token's slot is `block_id * block_size + offset`; `store` writes new tokens' K/V to their slots
(slot -1 = already cached, skipped). One extra block past `num_blocks`, never handed out, holds
`scratch_slot`: padding rows of a CUDA-graph batch write there. `free()` drops the tensors (engine `sleep`), `allocate()` takes
them back (`wake_up`). All layers' K and V are views of one allocation: an ordinary tensor, back at the same address
(`address`) only when the allocator still holds that block, so that the engine's captured decode graphs, which hold
it, stay valid across a sleep; or, on CUDA (unless LATHE_KV_FIXED_ADDRESS=0), fixed-address memory (`lathe.engine.vmm`:
`free()` gives it to the driver, `allocate()` maps new memory under the same addresses, whatever happened between).

An FP8 cache (`dtype=torch.float8_e4m3fn`, `kv_cache_dtype="fp8"`: verl's vLLM/SGLang key) stores each token's K and
V per KV head as e4m3 values with a float32 scale beside them (`k_scale[i]`, `v_scale[i]`: (num_blocks + 1,
block_size, kv_heads), one allocation `scales` for all layers): scale = max|x| / 448 over the head's head_dim values,
computed when the token is stored (`quantize`), so every stored head uses e4m3's whole range. vLLM's default, one
fixed scale of 1.0, clips what passes 448: Qwen2's k_proj bias makes some K heads that large. A head_dim of 128 then
takes 132 bytes a token and head instead of bf16's 256: the cache holds ~1.94x the tokens in the same memory
(`bytes_per_block` counts the scales). Readers dequantise (`dequantize`, the Triton kernels' loads) and attend in the
model's dtype.
"""

from __future__ import annotations

import math

import torch

from lathe.device import current_device, empty_cache, nvidia_capability, to_device
from lathe.engine import vmm
from lathe.engine.triton_store import FP8_MAX, can_store, store_kv

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}    # kv_cache_dtype -> the cache's storage dtype


def kv_storage_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype,
                     device: torch.device | None = None) -> torch.dtype:
    """The cache's storage dtype for `kv_cache_dtype` (vLLM's name: auto = the model's dtype; fp8 = fp8_e4m3). FP8 on
    CUDA needs an NVIDIA GPU of compute capability 8.9 or later: the Triton kernels' e4m3 type (fp8e4nv) has no
    conversions below it."""
    name = kv_cache_dtype or "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r}: lathe's engine stores its KV cache as "
                         f"{', '.join(KV_CACHE_DTYPES)} (fp8 = fp8_e4m3 with a scale per token and KV head; fp8_e5m2 "
                         "is not implemented). Fix: use one of those")
    if KV_CACHE_DTYPES[name] is not None and device is not None and device.type == "cuda":
        capability = nvidia_capability(device)
        if capability is None or capability < (8, 9):
            raise ValueError(f"kv_cache_dtype={name}: the FP8 KV cache's kernels need an NVIDIA GPU of compute "
                             f"capability 8.9 or later (Ada, Hopper); this one reports {capability}. Fix: set "
                             "actor_rollout_ref.rollout.kv_cache_dtype=auto (and no engine_kwargs kv_cache_dtype)")
    return KV_CACHE_DTYPES[name] or model_dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (e4m3 values (..., head_dim), float32 scales (...)): scale = max|x| x (1 / 448) over the
    last dimension (at least 1e-12 / 448, so that a zero row divides safely), values = x / scale. (A product by the
    reciprocal, as PyTorch divides a CUDA tensor by a scalar anyway: the Triton stores compute the same.)"""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(1e-12) * (1.0 / FP8_MAX)
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (the same bytes: PyTorch's index_copy_ and indexing have no FP8 kernels), others as
    they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """values (..., head_dim) times their scales (...) in float32, in `dtype`; without scales, values in `dtype`."""
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale[..., None]).to(dtype)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", latent: bool = False):
        """`latent`: the cache holds DeepSeek-V3's latent per token (`lathe.engine.mla`), which is its K and its V
        alike: one buffer, `v[i]` the same tensor as `k[i]` (a store of each writes the same values)."""
        self.shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)   # + the scratch block
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.latent = latent
        self.quantized = dtype == FP8               # an FP8 cache: values and their scales (module doc)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []       # FP8: (num_blocks + 1, block_size, kv_heads) float32 each
        self.v_scale: list[torch.Tensor] = []
        self.buffer: torch.Tensor | None = None     # (2, layers, *shape): k[i] is buffer[0, i], v[i] buffer[1, i]
        self.scales: torch.Tensor | None = None     # FP8: (2, layers, *shape[:-1]), as `buffer`
        self._fixed = None                          # on CUDA: the `vmm.FixedAddress` both live in (module doc)
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, latent: bool = False) -> int:
        """Bytes one block takes over all layers, K and V (one of them for a `latent` cache; an FP8 cache's float32
        scales included)."""
        per_head = head_dim * torch.empty(0, dtype=dtype).element_size() + (4 if dtype == FP8 else 0)
        return (1 if latent else 2) * num_layers * block_size * num_kv_heads * per_head

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
        return self.bytes_per_block(self.num_layers, *self.shape[1:], self.dtype, self.latent) * self.shape[0]

    @property
    def fixed_address(self) -> bool:
        """Whether the cache comes back under the same addresses at every `allocate()` of its size (`vmm`)."""
        return self._fixed is not None

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def address(self) -> tuple[int, tuple[int, ...], int | None] | None:
        """Where the cache lives (an FP8 cache's scales too) and its shape, or None when freed: equal addresses mean
        kernels captured against the one can run on the other."""
        if self.buffer is None:
            return None
        return self.buffer.data_ptr(), self.shape, None if self.scales is None else self.scales.data_ptr()

    def allocate(self) -> None:
        if self.allocated:
            return
        # both allocations before either is kept: `wake_up` retries an out-of-memory error, which must not leave values
        # without their scales
        sides = 1 if self.latent else 2             # (a latent cache's V is its K)
        values, scale_shape = (sides, self.num_layers) + self.shape, (sides, self.num_layers) + self.shape[:-1]
        value_bytes, scale_bytes = math.prod(values) * self.dtype.itemsize, math.prod(scale_shape) * 4
        at = -(-value_bytes // 256) * 256           # (fixed-address memory: the scales 256-byte aligned after)
        fixed = self._fixed_memory(at + scale_bytes if self.quantized else value_bytes)
        if fixed is not None:
            buffer = fixed[:value_bytes].view(self.dtype).view(values)
            scales = fixed[at:at + scale_bytes].view(torch.float32).view(scale_shape) if self.quantized else None
        else:
            buffer = torch.zeros(values, dtype=self.dtype, device=self.device)
            scales = torch.zeros(scale_shape, dtype=torch.float32, device=self.device) if self.quantized else None
        self.buffer, self.scales = buffer, scales
        self.k = list(buffer[0].unbind(0))
        self.v = self.k if self.latent else list(buffer[1].unbind(0))
        if scales is not None:
            self.k_scale = list(scales[0].unbind(0))
            self.v_scale = self.k_scale if self.latent else list(scales[1].unbind(0))

    def _fixed_memory(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` at the addresses the cache had before (`vmm`): a reservation of that size, made at the first
        allocation and again when the size changes; None off CUDA, where the driver does not take it, or with
        LATHE_KV_FIXED_ADDRESS=0. An out-of-memory error first empties PyTorch's cached blocks (the trainer's, on
        waking) and tries once more."""
        if self.device.type != "cuda" or not vmm.supported(
                self.device.index if self.device.index is not None else current_device("cuda").index):
            return None
        if self._fixed is not None and self._fixed.requested != nbytes:
            self._fixed.close()
            self._fixed = None
        if self._fixed is None:
            self._fixed = vmm.FixedAddress(nbytes, self.device)
        try:
            return self._fixed.map()
        except torch.OutOfMemoryError:
            empty_cache(self.device)
            return self._fixed.map()

    def free(self) -> None:
        """Drop the cache; its memory goes back to the driver where it is fixed-address memory, else to PyTorch's
        allocator."""
        self.k, self.v, self.buffer = [], [], None
        self.k_scale, self.v_scale, self.scales = [], [], None
        if self._fixed is not None:
            self._fixed.unmap()

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of `layer` for the readers (`paged_attention`, `triton_decode`), None unless FP8."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k/v (T, kv_heads, head_dim) to the slots `slot_mapping` (T,); slots < 0 are skipped."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        self._index_store(layer, k, v, slot_mapping)

    def store_unchecked(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """`store` for slots known to be valid: no host sync, so it can be captured in a CUDA graph. On CUDA one
        Triton launch writes both (`triton_store`)."""
        if can_store(k, v):
            store_kv(k, v, self.k[layer], self.v[layer], slot_mapping, self.layer_scales(layer))
            return
        self._index_store(layer, k, v, slot_mapping)

    def _index_store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k/v at `slot_mapping` by `index_copy_` (quantised with their scales in an FP8 cache)."""
        flat = (-1,) + self.shape[2:]
        for x, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale))[:1 if self.latent else 2]:
            if self.quantized:
                x, scale = quantize(x)
                scales[layer].view(-1, self.shape[2]).index_copy_(0, slot_mapping, scale)
            as_bytes(cache[layer]).view(flat).index_copy_(0, slot_mapping, as_bytes(x.to(self.dtype)))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared partial blocks)."""
        if not pairs:
            return
        src, dst = to_device(torch.tensor(pairs).T.contiguous(), self.device)
        for cache in self.k + self.k_scale if self.latent else self.k + self.v + self.k_scale + self.v_scale:
            cache = as_bytes(cache)
            cache[dst] = cache[src]
