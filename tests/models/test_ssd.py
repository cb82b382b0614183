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


# ---- fla's chunk_simple_gla on CUDA (`ssd._fla_scan`) -----------------------------------------------------------

def simple_gla_reference(q, k, v, g, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """fla's `chunk_simple_gla` as its documentation states it, token by token per packed sequence: q, k (1, T, H, K),
    v (1, T, H, V), g (1, T, H) the log decay; S_t = exp(g_t) S_{t-1} + k_t v_t^T (K x V), o_t = scale S_t^T q_t;
    states stored (V, K) under state_v_first. Only the arguments lathe passes are taken."""
    assert state_v_first and output_final_state and cu_seqlens.dtype == torch.int64
    assert q.dtype == k.dtype == v.dtype and g.dtype == torch.float32
    heads, keys, values = k.shape[2], k.shape[3], v.shape[3]
    outs, finals = [], []
    for i in range(cu_seqlens.numel() - 1):
        state = (torch.zeros(heads, keys, values, dtype=torch.float32) if initial_state is None
                 else initial_state[i].transpose(-1, -2))
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            state = state * g[0, t].exp()[:, None, None] + k[0, t].float()[:, :, None] * v[0, t].float()[:, None, :]
            outs.append(scale * (state * q[0, t].float()[:, :, None]).sum(-2))
        finals.append(state.transpose(-1, -2))
    return torch.stack(outs)[None].to(v.dtype), torch.stack(finals)


def _as_if_on_cuda(monkeypatch, fla=simple_gla_reference, broken=False):
    from lathe.models import linear_attention as la
    from lathe.models import ssd
    monkeypatch.setattr(la, "_on_cuda", lambda x: True)
    monkeypatch.setattr(ssd, "fla_scan", lambda: fla)
    monkeypatch.setattr(la, "_broken_triton", lambda device: broken)
    monkeypatch.setattr(la, "_CHECKED", {})
    return la, ssd


@pytest.mark.parametrize("with_initial", [False, True])
def test_flas_scan_takes_the_mamba2_scan_as_simple_gla(monkeypatch, with_initial):
    """chunk_scan through fla's entry (stood in for by the reference of its documented semantics above): the torch
    form's output, final states and gradients (x, dt, A, B, C, D, the initial states), float32."""
    from lathe.models import ssd
    lengths = [6, 1, 11]
    leaves = [t.float().requires_grad_() for t in inputs(lengths, seed=6)[:7]]
    cu = inputs(lengths)[7]
    gen = torch.Generator().manual_seed(7)
    results = []
    for through_fla in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if through_fla:
                _as_if_on_cuda(mp)
            x, dt, A, B, C, D, initial = leaves
            assert ssd._fla_takes(x, dt, A, B, C, initial) is through_fla
            y, final = chunk_scan(x, dt, A, B, C, cu, max(lengths), D=D, initial_state=initial if with_initial
                                  else None, chunk_size=4)
        if not through_fla:
            wy, wf = torch.randn(y.shape, generator=gen), torch.randn(final.shape, generator=gen)
        grads = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), leaves, allow_unused=True)
        results.append((y, final, grads))
    (y0, f0, g0), (y1, f1, g1) = results
    assert rel(y1, y0) < 1e-5 and rel(f1, f0) < 1e-5
    for name, a, b in zip("x dt A B C D initial".split(), g1, g0):
        if name == "initial" and not with_initial:
            assert a is None and b is None
        else:
            assert rel(a, b) < 1e-5, name


def test_float64_and_cpu_scans_stay_on_the_torch_form(monkeypatch):
    from lathe.models import ssd
    x, dt, A, B, C, D, initial, cu = inputs([4])
    assert not ssd._fla_takes(x.float(), dt, A, B, C, None)                 # on CPU
    _as_if_on_cuda(monkeypatch)
    assert not ssd._fla_takes(x, dt, A, B, C, None)                         # float64
    assert ssd._fla_takes(x.float(), dt.float(), A.float(), B.float(), C.float(), None)
    monkeypatch.setattr(ssd, "fla_scan", lambda: None)                      # fla not installed
    assert not ssd._fla_takes(x.float(), dt.float(), A.float(), B.float(), C.float(), None)


def test_a_slow_first_use_of_flas_kernels_says_they_are_compiling(monkeypatch, caplog):
    """The first forward and backward of fla's scan at a layout (stood in for by a reference that takes 0.3 s each
    way, as Triton compiling would take minutes) log that fla is compiling its kernels and when they are ready;
    later calls at that layout, and a first call quicker than the notice's delay, log nothing; the gradients are
    the same as without the watch."""
    import logging
    import time

    from .test_hybrid_kernels import _backward_runs
    slow_backward = _backward_runs(lambda grad: (time.sleep(0.3), grad)[1])

    def slow(*args, **kwargs):
        time.sleep(0.3)
        out, state = simple_gla_reference(*args, **kwargs)
        return slow_backward.apply(out), state
    la, ssd = _as_if_on_cuda(monkeypatch, fla=slow)
    monkeypatch.setattr(la, "FIRST_USE_NOTICE_S", 0.1)
    monkeypatch.setattr(la, "_used", set())
    lengths = [3, 5]
    x, dt, A, B, C, D, initial, cu = inputs(lengths, seed=2)
    leaves = [t.float().requires_grad_() for t in (x, dt, A, B, C)]
    caplog.set_level(logging.INFO, logger="lathe")
    grads = []
    for _ in range(2):
        caplog.clear()
        y, _ = chunk_scan(*leaves, cu, max(lengths), D=D.float())
        grads.append(torch.autograd.grad(y.square().sum(), leaves))
        lines = [r.getMessage() for r in caplog.records]
        if not grads[1:]:
            for phase in ("forward", "backward"):
                assert any(f"compiling and autotuning its {ssd.WHAT} {phase} kernels for 4 heads of 3 with states of "
                           f"5, float32" in m for m in lines), (phase, lines)
                assert any(f"{ssd.WHAT} {phase} kernels for 4 heads of 3 with states of 5, float32 are ready" in m
                           for m in lines), (phase, lines)
        else:
            assert not lines, lines
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-6
    caplog.clear()
    monkeypatch.setattr(la, "FIRST_USE_NOTICE_S", 30.0)
    with torch.no_grad():                                                   # a new key (no gradient), quick
        chunk_scan(*(t.detach() for t in leaves), cu, max(lengths), D=D.float())
    assert not caplog.records
    monkeypatch.setattr(la, "FIRST_USE_NOTICE_S", 0.1)
    with torch.no_grad():                    # from given states: another variant of the kernels, named as one
        chunk_scan(*(t.detach() for t in leaves), cu, max(lengths), D=D.float(), initial_state=initial.float())
    lines = [r.getMessage() for r in caplog.records]
    assert any("forward kernels for 4 heads of 3 with states of 5, float32, from given states are ready" in m
               for m in lines), lines


def test_a_watched_first_call_under_checkpointing_gives_the_unwatched_gradients(monkeypatch):
    """The watch's identity marks inside a non-reentrant checkpointed forward (recomputed without them): the
    gradients of a forward without the watch."""
    from torch.utils.checkpoint import checkpoint
    la, _ = _as_if_on_cuda(monkeypatch)
    *leaves, _, cu = inputs([3, 5], seed=1)
    grads = []
    for watch in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(la, "_used", set())
            if not watch:
                mp.setattr(la, "first_use", lambda *args: None)
            mine = [t.float().detach().requires_grad_() for t in leaves[:5]]
            y = checkpoint(lambda *a: chunk_scan(*a, cu, 5, D=leaves[5].float())[0], *mine, use_reentrant=False)
            grads.append(torch.autograd.grad(y.square().sum(), mine))
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-6


def test_a_first_use_that_fails_leaves_no_watch_running(monkeypatch, caplog):
    """fla's scan raising at its first call: the error reaches the caller, and no line follows it later."""
    import logging
    import time

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")
    la, _ = _as_if_on_cuda(monkeypatch, fla=fails)
    monkeypatch.setattr(la, "FIRST_USE_NOTICE_S", 0.05)
    monkeypatch.setattr(la, "_used", set())
    *leaves, _, cu = inputs([3])
    x, dt, A, B, C, D = (t.float() for t in leaves)
    caplog.set_level(logging.INFO, logger="lathe")
    with pytest.raises(RuntimeError, match="out of memory"):
        chunk_scan(x, dt, A, B, C, cu, 3, D=D)
    time.sleep(0.2)
    assert not caplog.records


@pytest.mark.parametrize("state", [16, 128])
def test_on_flas_broken_tritons_the_scan_trains_on_fla_only_where_its_check_passes(monkeypatch, state):
    """Hopper with Triton 3.4 .. 3.7.0 (fla #640): forward-only calls take fla's kernels; a training call takes them
    for states wider than 64 once the layout's check passes (run once a layout), else the torch form."""
    la, ssd = _as_if_on_cuda(monkeypatch, broken=True)
    checks = []
    monkeypatch.setattr(la, "_lift_fla_guard", lambda: True)
    monkeypatch.setattr(ssd, "_layout_ok", lambda *layout: checks.append(layout) or (True, True))
    x = torch.zeros(5, 2, 3)
    dt, A, B = torch.ones(5, 2), -torch.ones(2), torch.zeros(5, 1, state)
    assert ssd._fla_takes(x, dt, A, B, B, None)                             # no gradient: fla
    A.requires_grad_()
    assert ssd._fla_takes(x, dt, A, B, B, None) is (state > 64)
    assert ssd._fla_takes(x, dt, A, B, B, None) is (state > 64)
    assert checks == ([(torch.device("cpu"), 2, state, 3, torch.float32, torch.float32)] if state > 64 else [])
    with torch.no_grad():
        assert ssd._fla_takes(x, dt, A, B, B, None)


@pytest.mark.parametrize("wrong", [None, "o", "x", "dt", "A", "raises"])
def test_a_scan_layout_passes_its_check_only_where_flas_output_and_gradients_agree(monkeypatch, wrong):
    """`ssd._layout_ok` on CPU with fla's scan stood in for by the torch form: right; with its output 20% off on
    the one-chunk sequence (the worst sequence counts, not the stream), or x's or dt's gradient doubled on the lone
    token's, or A's (the heads' rates, a whole) doubled; raising."""
    from lathe.models import linear_attention as la
    from lathe.models import ssd
    monkeypatch.setattr(la, "CHECK_LENGTHS", (1, 64, 300, 200))             # (the suite's time)
    from .test_hybrid_kernels import _DoubleGrad as doubled

    def stand_in(x, dt, A, B, C, cu, D, initial):
        if wrong == "raises":
            raise RuntimeError("no kernel")
        if wrong in ("x", "dt"):
            inputs_ = {"x": x, "dt": dt}
            t = inputs_[wrong]
            inputs_[wrong] = torch.cat([doubled.apply(t[:1]), t[1:]])
            x, dt = inputs_["x"], inputs_["dt"]
        if wrong == "A":
            A = doubled.apply(A)
        y, state = ssd.torch_scan(x, dt, A, B, C, cu, int((cu[1:] - cu[:-1]).max()), D=D, initial_state=initial)
        return (torch.cat([y[:1], y[1:65] * 1.2, y[65:]]) if wrong == "o" else y), state
    monkeypatch.setattr(ssd, "_fla_scan", stand_in)
    want = {None: (True, True), "o": (False, False), "raises": (True, False)}.get(wrong, (True, False))
    assert ssd._layout_ok(torch.device("cpu"), 2, 8, 4, torch.float32, torch.float32) == want


@pytest.mark.gpu
@pytest.mark.parametrize("state", [16, 128])
def test_flas_scan_equals_the_torch_form_on_cuda(state):
    """fla's kernels (when installed) at a small layout and at Nemotron-H's state size, bf16 inputs: output, final
    states and gradients near the float32 torch form's, with and without initial states; on Hopper's broken Tritons
    state 128 trains once its layout's check passes (what lifts fla's refusal) and state 16 runs forward only."""
    from lathe.models import linear_attention as la
    from lathe.models import ssd
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if ssd.fla_scan() is None:
        pytest.skip("flash-linear-attention is not installed")
    device = torch.device("cuda")
    broken = la._broken_triton(device)         # Hopper, Triton 3.4 .. 3.7.0: fla refuses this backward (fla #640)
    if broken:
        assert la._lift_fla_guard()
    trains = state > la.SAFE_KEY_TILE_ABOVE or not broken      # else training takes the torch form (forward: fla)
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 64, 300, 777]
    t, heads, groups = sum(lengths), 16, 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    softplus = torch.nn.functional.softplus
    host = [torch.randn(t, heads, 64, generator=gen), softplus(torch.randn(t, heads, generator=gen) - 2),
            -(torch.rand(heads, generator=gen) * 4 + 0.5), torch.randn(t, groups, state, generator=gen) / state ** 0.5,
            torch.randn(t, groups, state, generator=gen) / state ** 0.5, torch.randn(heads, generator=gen),
            torch.randn(len(lengths), heads, 64, state, generator=gen)]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
              torch.float32]
    for with_initial in (False, True):
        low = [h.to(device, d).requires_grad_() for h, d in zip(host, dtypes)]
        exact = [h.detach().float().requires_grad_() for h in low]
        x, dt, A, B, C, D, initial = low
        assert ssd._fla_takes(x, dt, A, B, C, initial) is trains      # (the layout's check at its first call)
        if broken and trains:
            assert la._CHECKED[ssd._layout(x, B, dt)] == (True, True)
        got, want = [], []
        for leaves, fn, out in ((low, ssd._fla_scan, got), (exact, None, want)):
            x, dt, A, B, C, D, initial = leaves
            initial = initial if with_initial else None
            with torch.set_grad_enabled(trains):
                y, final = (fn(x, dt, A, B, C, cu, D, initial) if fn else
                            ssd.torch_scan(x, dt, A, B, C, cu, max(lengths), D=D, initial_state=initial))
            out.extend([y.float(), final])
            if trains:
                (y.float().square().sum() + final.square().sum()).backward()
                out.extend(p.grad for p in leaves[:6])
        for name, a, b in zip("y final x dt A B C D".split(), got, want):
            assert rel(a.float(), b) < 3e-2, (name, with_initial)
