"""A decode step's per-row inputs in one Triton launch, inside its CUDA graph.

From each row's position (-1 for a padding row) and block table: the KV slot its token goes to (a padding row's is
the cache's scratch slot), its context length (position + 1; one token for a padding row) and its RoPE (cos, sin)
row, copied from a table the model's own `RotaryEmbedding` computed once for every position (`rope_table`), so
each row is bit for bit what the model computes for that position. In PyTorch these were about eighteen small
kernels a step (clamp, divide, gather, multiply, where; float, multiply, cat, cos, sin, scale, cast), a sizeable
share of the kernels outside the layers; `bench/decode_profile.py` measures a step's kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the PyTorch ops are used
    triton = None


if triton is not None:
    @triton.jit
    def _step_inputs_kernel(POS, TABLES, stride_t, ROPE, rope_rows, SLOTS, LENS, OUT_ROPE, scratch,
                            BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
        row = tl.program_id(0)
        pos = tl.load(POS + row)
        real = tl.maximum(pos, 0)
        block = tl.load(TABLES + row * stride_t + real // BLOCK_SIZE).to(tl.int64)
        tl.store(SLOTS + row, tl.where(pos >= 0, block * BLOCK_SIZE + real % BLOCK_SIZE, scratch))
        tl.store(LENS + row, (real + 1).to(tl.int32))
        at = tl.minimum(real, rope_rows - 1)         # never beyond the table (the engine ends sequences before)
        d = tl.arange(0, WIDTH_PAD)
        ok = d < WIDTH
        tl.store(OUT_ROPE + row * WIDTH + d, tl.load(ROPE + at * WIDTH + d, mask=ok), mask=ok)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def rope_table(rotary, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(length, 2 * head_dim) rows [cos | sin] of positions 0 .. length-1, computed by `rotary` (a
    `lathe.models.rope.RotaryEmbedding`) exactly as the model's forward computes them."""
    positions = torch.arange(length, device=device)
    cos, sin = rotary(positions, dtype)
    return torch.cat([cos, sin], dim=-1).contiguous()


def step_inputs(positions: torch.Tensor, tables: torch.Tensor, rope: torch.Tensor, block_size: int,
                scratch_slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions (B,) int64 (-1: a padding row), tables (B, width) int32 block tables, rope (`rope_table`) ->
    (slots (B,) int64, context lengths (B,) int32, cos (B, D), sin (B, D)); cos and sin are views of one
    (B, 2D) tensor (rows contiguous, as the decode kernels take them)."""
    b, width = positions.shape[0], rope.shape[1]
    slots = torch.empty(b, dtype=torch.int64, device=positions.device)
    lens = torch.empty(b, dtype=torch.int32, device=positions.device)
    out = torch.empty(b, width, dtype=rope.dtype, device=positions.device)
    if b:
        _step_inputs_kernel[(b,)](positions, tables, tables.stride(0), rope, rope.shape[0], slots, lens, out,
                                  scratch_slot, BLOCK_SIZE=block_size, WIDTH=width,
                                  WIDTH_PAD=triton.next_power_of_2(width), num_warps=1)
    half = width // 2
    return slots, lens, out[:, :half], out[:, half:]


def step_inputs_torch(positions: torch.Tensor, tables: torch.Tensor, block_size: int,
                      scratch_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, context lengths) of `step_inputs` in PyTorch ops: the decode graph's path without Triton or for a VL
    model (whose 3D RoPE the model computes itself), and the kernel's reference."""
    real = positions.clamp_min(0)
    block = tables.gather(1, (real // block_size)[:, None])[:, 0].long()
    slots = torch.where(positions >= 0, block * block_size + real % block_size, scratch_slot)
    return slots, (real + 1).int()
