"""The in-place decode step of the gated delta rule (`lathe.engine.triton_gdn`) against the token-by-token torch form
on gathered states (float64), and its short convolution against `conv_step`: outputs, each row's slot advanced, every
other slot untouched."""

import pytest
import torch

from lathe.engine import triton_gdn
from lathe.models.linear_attention import conv_step, recurrent_gated_delta_rule

from helpers import assert_close_rel


def _case(device, rows=5, hk=2, hv=4, dk=16, dv=24, slots=9, seed=0):
    """Inputs as `GatedDeltaNet.step` hands them over: q, k, v views into one projection row (row stride wider than
    the heads), the rows at scattered slots; the last row at the scratch slot (`slots - 1`) with the one before."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(rows, 2 * hk * dk + hv * dv + 3, generator=gen)
    q, k, v = mixed[:, :-3].split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    g = -torch.rand(rows, hv, generator=gen) * 2
    beta = torch.rand(rows, hv, generator=gen)
    states = torch.randn(slots, hv, dk, dv, generator=gen)
    index = torch.tensor([3, 0, 6, slots - 1, slots - 1][:rows])
    return [t.to(device) for t in (q, k, v, g, beta, states, index)]


def _reference(q, k, v, g, beta, states, index):
    o, final = recurrent_gated_delta_rule(*(t.double().unsqueeze(1) for t in (q, k, v, g, beta)),
                                          states.double()[index])
    return o.squeeze(1), final


def _check(q, k, v, g, beta, states, index, rel):
    before = states.clone()
    want_o, want_states = _reference(q, k, v, g, beta, before, index)
    got_o = triton_gdn.gated_delta_step_(q, k, v, g, beta, states, index)
    real = index[:-2]                     # the scratch slot's two writers race: only the real rows are compared
    assert_close_rel(got_o[:-2], want_o[:-2], rel=rel, name="outputs")
    assert_close_rel(states[real], want_states[:-2], rel=rel, name="advanced states")
    untouched = [s for s in range(states.shape[0]) if s not in index.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_in_place_step_equals_the_recurrence_on_gathered_states(triton_interpreter):
    _check(*_case("cpu"), rel=1e-5)


@pytest.mark.gpu
def test_in_place_step_on_cuda_and_through_the_linear_step():
    """On a GPU: bf16 inputs, float32 states, Qwen3.5's head size (the engine's GPU tests run it inside the graphs)."""
    q, k, v, g, beta, states, index = _case("cuda", rows=5, hk=4, hv=8, dk=128, dv=128)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    _check(q, k, v, g, beta, states, index, rel=1e-2)


def _conv_case(device, rows=5, channels=40, kernel=4, slots=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels + 8, generator=gen)[:, :channels]          # a view: row stride wider than C
    weight = torch.randn(channels, kernel, generator=gen)
    states = torch.randn(slots, channels, kernel - 1, generator=gen)
    index = torch.tensor([3, 0, 6, slots - 1, slots - 1][:rows])
    return [t.to(device) for t in (x, weight, states, index)]


def _check_conv(x, weight, states, index, rel, bias=None):
    before = states.clone()
    want, want_states = conv_step(x.double(), weight.double(), before.double()[index],
                                  None if bias is None else bias.double())
    got = triton_gdn.conv_step_(x, weight, states, index, bias)
    real = index[:-2]
    assert_close_rel(got[:-2], want[:-2], rel=rel, name="convolved inputs")
    assert torch.equal(states[real], want_states[:-2].to(states.dtype))      # the window moved on by one, exactly
    untouched = [s for s in range(states.shape[0]) if s not in index.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("bias", [False, True])
def test_in_place_conv_step_equals_the_torch_step_on_gathered_inputs(triton_interpreter, bias):
    """With Mamba2's bias (Nemotron-H) and without (Qwen3.5)."""
    x, weight, states, index = _conv_case("cpu")
    _check_conv(x, weight, states, index, rel=1e-5,
                bias=torch.randn(x.shape[1], generator=torch.Generator().manual_seed(2)) if bias else None)


@pytest.mark.gpu
def test_in_place_conv_step_on_cuda():
    x, weight, states, index = _conv_case("cuda", channels=6144)
    _check_conv(x.bfloat16(), weight.bfloat16(), states.bfloat16(), index, rel=1e-2)
