"""Mamba2's in-place decode step (`lathe.engine.triton_ssd`) against `lathe.models.ssd.scan_step` on gathered states
(float64): outputs, each row's slot advanced, every other slot untouched; and its compile for sm_90."""

import pytest
import torch

from lathe.models.ssd import scan_step

from helpers import assert_close_rel, compile_sm90, compiles_for_hopper


def _case(device, rows=5, heads=4, groups=2, head_dim=24, size=16, slots=9, seed=0):
    """Inputs as `Mamba2Mixer.step` hands them over: x, B and C views into one convolved row (row stride wider than
    the heads), dt after softplus, the rows at scattered slots; the last row at the scratch slot with the one
    before."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(rows, heads * head_dim + 2 * groups * size + 3, generator=gen)
    x, B, C = mixed[:, :-3].split([heads * head_dim, groups * size, groups * size], dim=-1)
    x, B, C = x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (groups, size)), C.unflatten(-1, (groups, size))
    dt = torch.nn.functional.softplus(torch.randn(rows, heads, generator=gen))
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    D = torch.randn(heads, generator=gen)
    states = torch.randn(slots, heads, head_dim, size, generator=gen)
    index = torch.tensor([3, 0, 6, slots - 1, slots - 1][:rows])
    return [t.to(device) for t in (x, dt, A, B, C, D, states, index)]


def _check(x, dt, A, B, C, D, states, index, rel):
    from lathe.engine import triton_ssd
    before = states.clone()
    want, want_states = scan_step(*(t.double() for t in (x, dt, A, B, C)), before.double()[index],
                                  D=None if D is None else D.double())
    got = triton_ssd.scan_step_(x, dt, A, B, C, D, states, index)
    real = index[:-2]                     # the scratch slot's two writers race: only the real rows are compared
    assert got.dtype == x.dtype
    assert_close_rel(got[:-2], want[:-2], rel=rel, name="outputs")
    assert_close_rel(states[real], want_states[:-2], rel=rel, name="advanced states")
    untouched = [s for s in range(states.shape[0]) if s not in index.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("with_d", [True, False])
def test_in_place_scan_step_equals_the_torch_step_on_gathered_states(triton_interpreter, with_d):
    x, dt, A, B, C, D, states, index = _case("cpu")
    _check(x, dt, A, B, C, D if with_d else None, states, index, rel=1e-5)


def test_a_head_size_that_is_no_power_of_two_is_masked(triton_interpreter):
    _check(*_case("cpu", head_dim=40, size=12, heads=6, groups=3), rel=1e-5)


@pytest.mark.gpu
def test_in_place_scan_step_on_cuda():
    """On a GPU: bf16 inputs, float32 states, Nemotron-3-Nano's layout (the engine's GPU tests run it inside the
    graphs)."""
    x, dt, A, B, C, D, states, index = _case("cuda", rows=5, heads=64, groups=8, head_dim=64, size=128)
    x, B, C = (t.bfloat16() for t in (x, B, C))
    _check(x, dt, A, B, C, D, states, index, rel=1e-2)


def test_the_step_kernels_compile_for_hopper():
    """The scan step and the biased convolution step compile for sm_90 without a GPU (in a process of its own, as
    the tests run Triton's interpreter): Triton's type and shape checks, which the interpreter skips."""
    compiles_for_hopper("engine.test_triton_ssd:compile_step_kernels")


def compile_step_kernels() -> str:
    """`test_the_step_kernels_compile_for_hopper`'s child process: Nemotron-3-Nano's layout, bf16 inputs."""
    from lathe.engine import triton_gdn, triton_ssd
    try:
        compile_sm90(triton_ssd._scan_step_kernel,
                     {"X": "*bf16", "DT": "*fp32", "A": "*fp32", "B": "*bf16", "C": "*bf16", "D": "*fp32",
                      "Y": "*bf16", "S": "*fp32", "INDEX": "*i64", "stride_x": "i32", "stride_b": "i32",
                      "stride_c": "i32"},
                     {"H": 64, "G": 8, "P": 64, "N": 128, "BP": 32, "BN": 128, "HAS_D": True})
    except (RuntimeError, FileNotFoundError) as e:          # no ptxas in this triton
        if "ptxas" in str(e):
            return f"SKIP: triton cannot compile for sm_90 here: {e}"
        raise
    compile_sm90(triton_gdn._conv_step_kernel,
                 {"X": "*bf16", "W": "*bf16", "BIAS": "*bf16", "STATE": "*bf16", "OUT": "*bf16", "INDEX": "*i64",
                  "stride_x": "i32", "C": "i32"}, {"K": 4, "KP": 4, "BC": 256, "HAS_BIAS": True})
    return "compiled"
