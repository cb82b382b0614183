"""The decode step's inputs kernel (slots, context lengths, RoPE rows) against the PyTorch ops it replaces."""

import pytest
import torch

from lathe.engine import triton_step
from lathe.models.config import RopeConfig
from lathe.models.rope import RotaryEmbedding


@pytest.mark.parametrize("rope", [RopeConfig(rope_theta=10000.0),
                                  RopeConfig(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                             original_max_position_embeddings=64)])
def test_step_inputs_equal_the_torch_ops_and_the_models_rope(triton_interpreter, rope):
    """Every row's slot and length as the PyTorch ops compute them (a padding row, position -1: the scratch slot, one
    token, position 0's RoPE), and its cos/sin bit for bit what the model's RotaryEmbedding gives that position
    (yarn: scaled by its attention factor), looked up from the table built once."""
    g = torch.Generator().manual_seed(0)
    bs, width, length, dim = 4, 6, 24, 12
    rotary = RotaryEmbedding(rope, dim, 256)
    table = triton_step.rope_table(rotary, length, torch.bfloat16, torch.device("cpu"))
    positions = torch.randint(0, length, (9,), generator=g)
    positions[[2, 7]] = -1
    positions[0] = length - 1                                      # the table's last row
    tables = torch.randint(0, 50, (9, width), generator=g, dtype=torch.int32)
    slots, lens, cos, sin = triton_step.step_inputs(positions, tables, table, bs, scratch_slot=199)
    ref_slots, ref_lens = triton_step.step_inputs_torch(positions, tables, bs, scratch_slot=199)
    assert torch.equal(slots, ref_slots) and torch.equal(lens, ref_lens)
    assert slots[2] == 199 and lens[2] == 1
    ref_cos, ref_sin = rotary(positions.clamp_min(0), torch.bfloat16)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1      # as the decode kernels take them
