"""Mamba2's scan (`lathe.models.ssd`) against a token-by-token reference written from the recurrence
S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, and against transformers' torch form."""

from __future__ import annotations

import pytest
import torch

from lathe.models.ssd import chunk_scan, scan_step

H, P, G, N = 4, 3, 2, 5


def reference(x, dt, A, B, C, D, state):
    """One sequence, token by token, in float64: x (L, H, P), dt (L, H), B and C (L, G, N), state (H, P, N)."""
    states, ys = list(state), []
    for t in range(x.shape[0]):
        y = []
        for h in range(H):
            g = h // (H // G)
            states[h] = torch.exp(dt[t, h] * A[h]) * states[h] + dt[t, h] * torch.outer(x[t, h], B[t, g])
            y.append(states[h] @ C[t, g] + D[h] * x[t, h])
        ys.append(torch.stack(y))
    return torch.stack(ys), torch.stack(states)


def inputs(lengths, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(t, H, P, generator=gen, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(t, H, generator=gen, dtype=dtype))
    A = -torch.rand(H, generator=gen, dtype=dtype) * 2 - 0.1
    B, C = (torch.randn(t, G, N, generator=gen, dtype=dtype) for _ in range(2))
    D = torch.randn(H, generator=gen, dtype=dtype)
    initial = torch.randn(len(lengths), H, P, N, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return x, dt, A, B, C, D, initial, cu


def per_sequence(x, dt, A, B, C, D, initial, cu, with_initial):
    ys, finals = [], []
    for i in range(len(cu) - 1):
        s = slice(int(cu[i]), int(cu[i + 1]))
        state = initial[i].clone() if with_initial else torch.zeros_like(initial[i])
        y, final = reference(x[s], dt[s], A, B[s], C[s], D, state)
        ys.append(y)
        finals.append(final)
    return torch.cat(ys), torch.stack(finals)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("with_initial", [False, True])
def test_chunked_scan_equals_the_recurrence_per_packed_sequence(chunk, with_initial):
    lengths = [7, 1, 12, 8]                 # a partial chunk, one token, several chunks, exactly one or two chunks
    x, dt, A, B, C, D, initial, cu = inputs(lengths)
    y, final = chunk_scan(x, dt, A, B, C, cu, max(lengths), D=D, initial_state=initial if with_initial else None,
                          chunk_size=chunk)
    want_y, want_final = per_sequence(x, dt, A, B, C, D, initial, cu, with_initial)
    assert rel(y, want_y) < 1e-10 and rel(final, want_final) < 1e-10


def test_steps_continue_a_chunked_prefix_as_the_recurrence_does():
    lengths = [5, 9]
    x, dt, A, B, C, D, initial, cu = inputs([n + 3 for n in lengths], seed=1)
    want_y, want_final = per_sequence(x, dt, A, B, C, D, initial, cu, True)
    # the first `lengths` tokens of each sequence chunked, then three single-token steps for both at once
    prefix = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + n) for i, n in enumerate(lengths)])
    cu_prefix = torch.tensor([0, lengths[0], sum(lengths)])
    _, state = chunk_scan(x[prefix], dt[prefix], A, B[prefix], C[prefix], cu_prefix, max(lengths), D=D,
                          initial_state=initial, chunk_size=4)
    for j in range(3):
        rows = torch.tensor([int(cu[i]) + n + j for i, n in enumerate(lengths)])
        y, state = scan_step(x[rows], dt[rows], A, B[rows], C[rows], state, D=D)
        assert rel(y, want_y[rows]) < 1e-10
    assert rel(state, want_final) < 1e-10


def test_gradients_equal_those_of_the_recurrence():
    lengths = [6, 11]
    leaves = [t.requires_grad_() for t in inputs(lengths, seed=2)[:7]]
    x, dt, A, B, C, D, initial = leaves
    cu = torch.tensor([0, 6, 17])
    y, final = chunk_scan(x, dt, A, B, C, cu, 11, D=D, initial_state=initial, chunk_size=4)
    gen = torch.Generator().manual_seed(3)
    wy, wf = torch.randn(y.shape, generator=gen, dtype=y.dtype), torch.randn(final.shape, generator=gen,
                                                                               dtype=final.dtype)
    got = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), leaves)
    want_y, want_final = per_sequence(x, dt, A, B, C, D, initial, cu, True)
    want = torch.autograd.grad((want_y * wy).sum() + (want_final * wf).sum(), leaves)
    for name, a, b in zip("x dt A B C D initial".split(), got, want):
        assert rel(a, b) < 1e-9, name


def test_low_precision_inputs_run_in_float32_and_keep_their_dtype():
    x, dt, A, B, C, D, initial, cu = inputs([9, 4], seed=4, dtype=torch.float32)
    y, final = chunk_scan(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), cu, 9, D=D, chunk_size=4)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    want, _ = chunk_scan(x.bfloat16().float(), dt, A, B.bfloat16().float(), C.bfloat16().float(), cu, 9, D=D)
    assert rel(y.float(), want) < 1e-2


def test_equals_transformers_torch_mamba2_scan():
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt, A, B, C, D, initial, cu = inputs([16], seed=5, dtype=torch.float32)
    y, final = chunk_scan(x, dt, A, B, C, cu, 16, D=D, initial_state=initial, chunk_size=8)
    out = nemotron_h.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], chunk_size=8, D=D,
                                       initial_states=initial, return_final_states=True)
    want_y, want_final = out
    assert rel(y, want_y[0]) < 1e-5 and rel(final, want_final) < 1e-5


# ---- Nemotron-H's Mamba2 mixer (lathe.models.nemotron_h) against transformers' ---------------------------------

def tiny_nemotron_h(**over):
    from transformers import NemotronHConfig
    d = dict(vocab_size=64, hidden_size=32, layers_block_type=["mamba", "attention"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=6,
             conv_kernel=4, chunk_size=8, intermediate_size=48)
    d.update(over)
    return NemotronHConfig(**d)


@pytest.mark.parametrize("limit", [None, (0.05, 0.5)])
def test_the_mamba2_mixer_equals_transformers_on_packed_sequences_and_continues_from_its_states(limit):
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from lathe.models.nemotron_h import Mamba2Config, Mamba2Mixer
    hf_cfg = tiny_nemotron_h(**({} if limit is None else {"time_step_limit": limit}))
    torch.manual_seed(0)
    theirs = nemotron_h.NemotronHMamba2Mixer(hf_cfg, layer_idx=0).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.rand_like(theirs.A_log).add(0.5).log())
    cfg = Mamba2Config.from_hf_dict(hf_cfg.to_dict())
    assert (cfg.num_heads, cfg.n_groups, cfg.state_size, cfg.conv_kernel) == (8, 2, 6, 4)
    ours = Mamba2Mixer(cfg).double()
    ours.load_state_dict(theirs.state_dict())
    lengths = [5, 13, 1]
    x = torch.randn(sum(lengths), 32, dtype=torch.float64)
    cu = torch.tensor([0, 5, 18, 19])
    with torch.no_grad():
        want = torch.cat([theirs(x[cu[i]:cu[i + 1]][None])[0] for i in range(3)])
        got = ours(x, cu, 13)
        assert rel(got, want) < 1e-6        # (both compute the steps, the scan and the norm in float32)
        # the same sequences in two parts: the second continues from the first's states
        first = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + n) for i, n in enumerate([3, 6, 1])])
        rest = torch.cat([torch.arange(int(cu[i]) + n, int(cu[i + 1])) for i, n in enumerate([3, 6, 1])])
        zero = (torch.zeros(3, cfg.conv_dim, 3, dtype=torch.float64), torch.zeros(3, 8, 4, 6, dtype=torch.float64))
        out1, states = ours(x[first], torch.tensor([0, 3, 9, 10]), 6, zero)
        out2, _ = ours(x[rest], torch.tensor([0, 2, 9, 9]), 7, states)
        assert rel(out1, want[first]) < 1e-6 and rel(out2, want[rest]) < 1e-6
