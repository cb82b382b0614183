"""The gated delta rule and the short causal convolution of `lathe.models.linear_attention`: the chunked form
against the token-by-token recurrence (float64, several chunks, packed sequences of ragged lengths, grouped value
heads, carried states), and the packed convolution against one conv1d per sequence."""

import pytest
import torch

from lathe.models.linear_attention import causal_conv1d, chunk_gated_delta_rule, conv_state, conv_step, \
    fla_cu_seqlens, recurrent_gated_delta_rule

from helpers import assert_close_rel

LENGTHS = [5, 1, 13, 8]


def _inputs(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    q, k = (torch.randn(t, 2, 8, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(t, 4, 6, generator=gen, dtype=dtype)
    g = -torch.rand(t, 4, generator=gen, dtype=dtype) * 2
    beta = torch.rand(t, 4, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu


def _recurrent_per_sequence(q, k, v, g, beta, cu, states=None):
    outs, finals = [], []
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, state = recurrent_gated_delta_rule(*(x[a:b].unsqueeze(0) for x in (q, k, v, g, beta)),
                                              None if states is None else states[s:s + 1])
        outs.append(o[0])
        finals.append(state[0])
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_form_equals_the_recurrence_per_sequence(chunk_size):
    q, k, v, g, beta, cu = _inputs()
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, max(LENGTHS), chunk_size=chunk_size)
    ref_out, ref_final = _recurrent_per_sequence(q, k, v, g, beta, cu)
    assert out.dtype == torch.float64
    assert_close_rel(out, ref_out, rel=1e-10, name="outputs")
    assert_close_rel(final, ref_final, rel=1e-10, name="final states")


def test_a_carried_state_continues_the_sequence():
    """Prefill in two pieces (the second from the first's states) equals the whole: what a decode or a chunked
    prefill relies on."""
    q, k, v, g, beta, cu = _inputs(1)
    whole, whole_final = _recurrent_per_sequence(q, k, v, g, beta, cu)
    head_len = torch.tensor([min(2, n) for n in LENGTHS])
    head_cu = torch.nn.functional.pad(head_len.cumsum(0), (1, 0)).to(torch.int32)
    tail_cu = torch.nn.functional.pad((torch.tensor(LENGTHS) - head_len).cumsum(0), (1, 0)).to(torch.int32)
    starts = cu[:-1].long()
    head_idx = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), head_len.tolist())])
    tail_idx = torch.cat([torch.arange(s + n, s + m) for s, n, m in zip(starts.tolist(), head_len.tolist(), LENGTHS)])
    parts = [(x[head_idx], x[tail_idx]) for x in (q, k, v, g, beta)]
    head_out, states = chunk_gated_delta_rule(*(p[0] for p in parts), head_cu, 2, chunk_size=4)
    tail_out, final = chunk_gated_delta_rule(*(p[1] for p in parts), tail_cu, max(LENGTHS), chunk_size=4,
                                             initial_state=states)
    assert_close_rel(head_out, whole[head_idx], rel=1e-10, name="first piece")
    assert_close_rel(tail_out, whole[tail_idx], rel=1e-10, name="second piece")
    assert_close_rel(final, whole_final, rel=1e-10, name="final states")


def test_packed_convolution_equals_one_conv_per_sequence_and_carries_its_state():
    gen = torch.Generator().manual_seed(2)
    _, _, _, _, _, cu = _inputs()
    x = torch.randn(int(cu[-1]), 6, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    out = causal_conv1d(x, w, cu)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        ref = torch.nn.functional.conv1d(x[a:b].T.unsqueeze(0), w.unsqueeze(1), padding=3, groups=6)[0, :, :b - a]
        assert_close_rel(out[a:b], torch.nn.functional.silu(ref.T), rel=1e-12, name="convolution")
    # one more token per sequence, from the carried last K-1 inputs, equals the whole sequence's next output; so does
    # the decode step's single-token form, which also carries the inputs on as the longer sequence's `conv_state`
    step = torch.randn(len(LENGTHS), 6, generator=gen, dtype=torch.float64)
    one = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    nxt = causal_conv1d(step, w, one, initial=conv_state(x, cu, 4))
    single, carried = conv_step(step, w, conv_state(x, cu, 4))
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        longer = torch.cat([x[a:b], step[s:s + 1]])
        whole = causal_conv1d(longer, w, torch.tensor([0, len(longer)], dtype=torch.int32))
        assert_close_rel(nxt[s], whole[-1], rel=1e-12, name="carried convolution")
        assert_close_rel(single[s], whole[-1], rel=1e-12, name="single-token convolution")
        assert torch.equal(carried[s], conv_state(longer, torch.tensor([0, len(longer)], dtype=torch.int32), 4)[0])


def test_fla_is_handed_one_bounds_tensor_per_packed_batch():
    """fla memoises what it derives from cu_seqlens by the tensor's identity (a miss is a host sync): every layer of
    one packed batch hands it the same int64 tensor; new or changed bounds get a new one, never stale values."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = fla_cu_seqlens(cu)
    assert first.dtype == torch.long and first.tolist() == [0, 3, 7]
    assert fla_cu_seqlens(cu) is first                           # the next layer: fla's memo hits
    cu[2] = 9                                                    # written in place: new bounds, a new tensor
    changed = fla_cu_seqlens(cu)
    assert changed is not first and changed.tolist() == [0, 3, 9] and first.tolist() == [0, 3, 7]
    other = torch.tensor([0, 5], dtype=torch.long)
    taken = fla_cu_seqlens(other)
    assert taken is not other and taken.tolist() == [0, 5]      # an int64 input is copied: fla never memoises
    other[1] = 6                                                 # a tensor its owner may change in place
    assert fla_cu_seqlens(other).tolist() == [0, 6]
    assert fla_cu_seqlens(cu).tolist() == [0, 3, 9]
    three = [torch.tensor([0, k], dtype=torch.int32) for k in (1, 2, 3)]     # a prefix-grouped layer's bounds, in
    given = [fla_cu_seqlens(t) for t in three]                               # turn: each keeps its int64 tensor
    assert all(fla_cu_seqlens(t) is g for t, g in zip(three, given))
    for k in range(4):                                                       # four newer ones push the oldest out
        fla_cu_seqlens(torch.tensor([0, k + 10], dtype=torch.int32))
    assert fla_cu_seqlens(three[0]) is not given[0] and fla_cu_seqlens(three[0]).tolist() == [0, 1]
    with torch.inference_mode():        # the engine's prefills: no version counter to read; one step's bounds, made
        made = torch.tensor([0, 2, 4], dtype=torch.int32)         # afresh, serve every layer of the step
        assert fla_cu_seqlens(made).tolist() == [0, 2, 4] and fla_cu_seqlens(made) is fla_cu_seqlens(made)
        assert fla_cu_seqlens(made).is_inference()
        fresh = torch.tensor([0, 2, 4], dtype=torch.int32)        # the next step's: equal values, another tensor
        assert fla_cu_seqlens(fresh) is not fla_cu_seqlens(made)
    assert not fla_cu_seqlens(made).is_inference() and fla_cu_seqlens(made) is not fla_cu_seqlens(made)   # outside
    bounds = torch.tensor([0, 6], dtype=torch.int32)
    with torch.inference_mode():
        fla_cu_seqlens(bounds)                                   # a normal tensor's first use under inference mode
    assert not fla_cu_seqlens(bounds).is_inference()             # is not what training gets (fla saves it for backward)
    from lathe.models.attention import PaddedAttention              # a padded batch's rows: one tensor for all layers
    padded, cpu = PaddedAttention(None), torch.device("cpu")
    assert padded.row_bounds(2, 3, cpu) is padded.row_bounds(2, 3, cpu) and padded.row_bounds(2, 3, cpu).tolist() \
        == [0, 3, 6] and padded.row_bounds(3, 2, cpu).tolist() == [0, 2, 4, 6]


@pytest.mark.gpu
@pytest.mark.parametrize("inference", [False, True])
def test_fla_derives_a_packed_batchs_bounds_once_for_all_its_layers(monkeypatch, inference):
    """The convolution and the delta rule of every layer of one packed batch on fla: fla expands the sequence bounds
    (`_segmented_arange`, a host sync on a CUDA tensor) no more often for six layers than for two. Training: forward
    and backward (before `fla_cu_seqlens`, once more per call: the profiled Qwen3.5-2B update,
    bench/results/e2e_qwen3.5-2b_ckpt_profile_nvidia-h200.json), key heads of 128, whose backward runs on fla. The
    engine's prefill step of fresh sequences (`inference`): under inference mode, from zero states, the bounds an
    inference tensor made for the step (`LinearStateCache.step`)."""
    pytest.importorskip("fla")
    import fla.ops.utils.index as index
    expand = index._segmented_arange
    calls = []
    monkeypatch.setattr(index, "_segmented_arange", lambda counts: calls.append(1) or expand(counts))
    lengths, hk, hv, dk, dv = [300, 1, 77, 640, 64], 2, 4, 128, 128
    gen = torch.Generator().manual_seed(6)
    total, channels = sum(lengths), 2 * hk * dk + hv * dv

    def layers(n: int) -> int:
        calls.clear()
        # a new batch's bounds: fla derives them afresh, once
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        x = torch.randn(total, channels, generator=gen).cuda().to(torch.bfloat16).requires_grad_(not inference)
        h = x
        for _ in range(n):
            mixed = causal_conv1d(h, torch.randn(channels, 4, generator=gen).cuda() / 2, bounds)
            q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
            g = torch.nn.functional.logsigmoid(torch.randn(total, hv, generator=gen)).cuda() / 4
            beta = torch.rand(total, hv, generator=gen).cuda().to(torch.bfloat16)
            o, final = chunk_gated_delta_rule(q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)),
                                              v.unflatten(-1, (hv, dv)), g, beta, bounds, max(lengths))
            assert final.shape[0] == len(lengths)
            h = torch.cat([o.flatten(-2), h[:, hv * dv:]], dim=-1) + h
        if not inference:
            h.float().square().mean().backward()
        torch.cuda.synchronize()
        return len(calls)

    if inference:
        layers = torch.inference_mode()(layers)
    layers(1)                                # (fla's layout check, once)
    assert layers(6) == layers(2) > 0


@pytest.mark.gpu
def test_fla_kernels_equal_the_torch_form_on_cuda():
    pytest.importorskip("fla")
    q, k, v, g, beta, cu = (x.cuda() for x in _inputs(dtype=torch.float32))
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, max(LENGTHS))
    ref_out, ref_final = _recurrent_per_sequence(*(x.cpu().double() for x in (q, k, v, g, beta)), cu.cpu())
    # fla's Triton products run in TF32 (measured on an H200: 1.6e-3 on the outputs)
    assert_close_rel(out, ref_out, rel=5e-3, name="fla outputs")
    assert_close_rel(final, ref_final, rel=5e-3, name="fla final states")
    # the recurrent step (the engine's decode) from those states, one token per sequence, against the torch form
    gen = torch.Generator().manual_seed(5)
    step = [torch.randn(len(LENGTHS), 1, *t.shape[1:], generator=gen) for t in (q, k, v)]
    g1, b1 = -torch.rand(len(LENGTHS), 1, g.shape[-1], generator=gen), torch.rand(len(LENGTHS), 1, g.shape[-1],
                                                                                   generator=gen)
    got, got_state = recurrent_gated_delta_rule(*(t.cuda() for t in (*step, g1, b1)), final)
    want, want_state = recurrent_gated_delta_rule(*(t.double() for t in (*step, g1, b1)), ref_final)
    assert_close_rel(got, want, rel=5e-3, name="fla recurrent outputs")
    assert_close_rel(got_state, want_state, rel=5e-3, name="fla recurrent states")


@pytest.mark.gpu
@pytest.mark.parametrize("key_dim", [128, 32])
def test_fla_backward_equals_the_torch_form_on_cuda(key_dim):
    """Every gradient of the delta rule on fla's kernels against the torch form in float64, at Qwen3.5's head size
    (128) and a narrow one, on packed sequences across chunk boundaries, bf16 inputs as training feeds them. On Hopper
    with Triton 3.4 .. 3.7.0 the 128 case runs past fla's refusal (linear_attention.SAFE_KEY_TILE_ABOVE); the 32 case
    then trains on the torch form (the comparison still holds), elsewhere on fla."""
    pytest.importorskip("fla")
    from lathe.models import linear_attention
    lengths = [300, 1, 77, 640, 64]
    gen = torch.Generator().manual_seed(3)
    t = sum(lengths)
    q, k = (torch.randn(t, 2, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(t, 4, 128, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(t, 4, generator=gen)) / 4
    beta = torch.rand(t, 4, generator=gen).sigmoid()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    upstream = torch.randn(t, 4, 128, generator=gen).cuda()
    leaves = [x.cuda().to(torch.bfloat16).requires_grad_() for x in (q, k, v)] + \
        [x.cuda().requires_grad_() for x in (g, beta.to(torch.bfloat16))]
    narrow_on_torch = key_dim <= linear_attention.SAFE_KEY_TILE_ABOVE and linear_attention._broken_triton(torch.device("cuda"))
    assert linear_attention._fla_runs(*leaves, None, chunked=True) is not narrow_on_torch
    out, _ = chunk_gated_delta_rule(*leaves, cu, max(lengths))
    (out.float() * upstream).sum().backward()
    exact = [x.detach().cpu().double().requires_grad_() for x in leaves]
    want, _ = chunk_gated_delta_rule(*exact, cu.cpu(), max(lengths))
    (want * upstream.cpu().double()).sum().backward()
    assert_close_rel(out, want, rel=2e-2, name="outputs")
    for name, got, ref in zip("q k v g beta".split(), leaves, exact):
        assert_close_rel(got.grad, ref.grad, rel=3e-2, name=f"d{name}")


@pytest.mark.gpu
def test_fla_convolution_equals_the_torch_form_on_cuda():
    """The packed causal convolution on fla's kernels (bf16, as training feeds it) against the torch form in float64:
    output and both gradients, sequences shorter than the kernel among them."""
    pytest.importorskip("fla")
    from lathe.models import linear_attention
    assert linear_attention.fla_conv() is not None
    lengths = [300, 1, 2, 77, 640, 64]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(lengths), 96, generator=gen)
    w = torch.randn(96, 4, generator=gen) / 2
    upstream = torch.randn(sum(lengths), 96, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = [x.cuda().to(torch.bfloat16).requires_grad_(), w.cuda().requires_grad_()]
    out = causal_conv1d(*got, cu.cuda())
    (out.float() * upstream.cuda()).sum().backward()
    exact = [t.detach().cpu().double().requires_grad_() for t in got]
    want = causal_conv1d(*exact, cu)
    (want * upstream.double()).sum().backward()
    assert_close_rel(out, want, rel=2e-2, name="convolution")
    assert_close_rel(got[0].grad, exact[0].grad, rel=2e-2, name="dx")
    assert_close_rel(got[1].grad, exact[1].grad, rel=2e-2, name="dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("value_heads", [16, 32])
def test_flas_backward_passes_its_check_at_the_hybrid_families_layouts(value_heads):
    """The check that lifts fla's Hopper refusal (`_fla_layout_ok`), at Qwen3.5-2B's layout (16 value heads of
    128 x 128) and Qwen3-Next's / Qwen3.5-MoE's (32), bf16: every gradient within CHECK_TOLERANCE of the torch form
    (lifted where this Triton needs it; on others fla's backward runs as it is)."""
    pytest.importorskip("fla")
    from lathe.models import linear_attention as la
    device = torch.device("cuda")
    if la._broken_triton(device):
        assert la._lift_fla_guard()
    assert la._fla_layout_ok(device, value_heads, 128, 128, *[torch.bfloat16] * 3) == (True, True)   # (its log
    # line gives the errors)


def _fake_fla(monkeypatch):
    """fla's two modules the lift touches, as fla 0.6 lays them out: chunk_o's version flag, read by the launcher
    at call time, and the gated backward's module-level name of that launcher."""
    import sys
    import types
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = True, False
    ran = []

    def dqkwg(q, k, **kwargs):
        if not chunk_o.TRITON_ABOVE_3_7_1:
            raise RuntimeError("fla: refused on Hopper (#640)")
        ran.append(k.shape[-1])
        return "grads"
    gated = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    gated.chunk_bwd_dqkwg = dqkwg
    for name in ("fla", "fla.ops", "fla.ops.common", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk", gated)
    return chunk_o, gated, ran


def test_the_lift_of_flas_hopper_refusal_covers_wide_key_heads_only(monkeypatch, request):
    from lathe.models import linear_attention as la
    chunk_o, gated, ran = _fake_fla(monkeypatch)
    raw = gated.chunk_bwd_dqkwg
    la._lift_fla_guard.cache_clear()
    request.addfinalizer(la._lift_fla_guard.cache_clear)
    checked = []
    monkeypatch.setattr(la, "_CHECKED", {})
    monkeypatch.setattr(la, "_fla_layout_ok", lambda *layout: checked.append(layout) or (True, True))
    monkeypatch.setattr(la, "_broken_triton", lambda device: True)
    wide, narrow, v, beta = (torch.zeros(3, 1, 2, 128), torch.zeros(3, 1, 2, 64), torch.zeros(3, 1, 4, 32),
                             torch.zeros(3, 1, 4))
    assert not la._fla_backward_ok(narrow, v, beta) and gated.chunk_bwd_dqkwg is raw      # nothing wrapped yet
    assert la._fla_backward_ok(wide, v, beta) and la._fla_backward_ok(wide, v, beta)
    assert checked == [(torch.device("cpu"), 4, 128, 32, *[torch.float32] * 3)]          # one check a layout
    lifted = gated.chunk_bwd_dqkwg
    la._lift_fla_guard.cache_clear()
    assert lifted is not raw and la._lift_fla_guard() and gated.chunk_bwd_dqkwg is lifted   # wrapped once only
    assert gated.chunk_bwd_dqkwg(q=wide, k=wide, scale=1.0) == "grads" and ran == [128]   # (fla passes keywords)
    assert chunk_o.TRITON_ABOVE_3_7_1 is False                 # the flag is raised for that call only
    with pytest.raises(RuntimeError, match="refused"):          # a narrow head meets fla's own refusal
        gated.chunk_bwd_dqkwg(narrow, narrow)
    monkeypatch.setattr(la, "_broken_triton", lambda device: False)
    assert la._fla_backward_ok(torch.zeros(3, 1, 2, 32), v, beta)     # elsewhere fla's backward runs at any size


def test_the_lift_covers_flas_simple_gla_too(monkeypatch, request):
    """Mamba2's scan (`lathe.models.ssd`) runs fla's simple GLA, whose module imported the same launcher: the lift
    wraps it there too, with the same wrapper."""
    import sys
    import types
    from lathe.models import linear_attention as la
    chunk_o, gated, ran = _fake_fla(monkeypatch)
    simple = types.ModuleType("fla.ops.simple_gla.chunk")
    simple.chunk_bwd_dqkwg = gated.chunk_bwd_dqkwg
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", types.ModuleType("fla.ops.simple_gla"))
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla.chunk", simple)
    la._lift_fla_guard.cache_clear()
    request.addfinalizer(la._lift_fla_guard.cache_clear)
    assert la._lift_fla_guard() and simple.chunk_bwd_dqkwg is gated.chunk_bwd_dqkwg
    wide = torch.zeros(3, 1, 2, 128)
    assert simple.chunk_bwd_dqkwg(q=wide, k=wide, g=wide) == "grads" and ran == [128]
    assert chunk_o.TRITON_ABOVE_3_7_1 is False


def _backward_runs(fn):
    """An identity autograd function whose backward returns fn(grad)."""
    class Hook(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return fn(grad)
    return Hook


_DoubleGrad = _backward_runs(lambda grad: 2 * grad)


def test_no_layout_is_checked_inside_a_backward(monkeypatch):
    """A first grad-needing call inside a backward (a recompute) takes the torch form unchecked: its check's own
    backward would wait on the engine thread running it."""
    from lathe.models import linear_attention as la
    monkeypatch.setattr(la, "_CHECKED", {})
    monkeypatch.setattr(la, "_broken_triton", lambda device: True)
    monkeypatch.setattr(la, "_lift_fla_guard", lambda: True)
    monkeypatch.setattr(la, "_fla_layout_ok", lambda *layout: pytest.fail("checked inside a backward"))
    seen = []
    probe = _backward_runs(lambda grad: seen.append(la._fla_backward_ok(
        torch.zeros(3, 2, 128), torch.zeros(3, 2, 8), torch.zeros(3, 2))) or grad)
    probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False] and la._CHECKED == {}




@pytest.mark.parametrize("wrong", [None, "o", "q", "k", "v", "g", "beta", "raises"])
def test_a_layout_is_lifted_only_where_flas_output_and_gradients_agree(monkeypatch, wrong):
    """`_fla_layout_ok` on CPU with fla's chunk stood in for by the torch form: right; with its output 20% off, or one
    input's gradient doubled, on one short sequence only (the lone token, 1 of ~1k: the worst sequence counts, not the
    stream; q's, k's and g's on the one-chunk sequence: a lone token's are ~0 against a typical sequence's, the
    floor of the check's error measure); raising."""
    from lathe.models import linear_attention as la
    monkeypatch.setattr(la, "CHECK_LENGTHS", (1, 64, 300, 400, 200))          # (the suite's time)
    names = ("q", "k", "v", "g", "beta")
    one = la.CHECK_LENGTHS.index(64 if wrong in ("q", "k", "g") else 1)
    start, end = sum(la.CHECK_LENGTHS[:one]), sum(la.CHECK_LENGTHS[:one + 1])

    def stand_in(*args):
        if wrong == "raises":
            raise RuntimeError("no kernel")
        *inputs, cu, initial = args
        if wrong in names:        # the wrong gradient only on that sequence's rows
            i = names.index(wrong)
            x = inputs[i]
            inputs[i] = torch.cat([x[:start], _DoubleGrad.apply(x[start:end]), x[end:]])
        out, state = la._torch_chunk(*inputs, cu, int((cu[1:] - cu[:-1]).max()), initial)
        if wrong == "o":
            out = torch.cat([out[:start], out[start:end] * 1.2, out[end:]])
        return out, state
    monkeypatch.setattr(la, "_fla_chunk", stand_in)
    want = {None: (True, True), "o": (False, False), "raises": (True, False)}.get(wrong, (True, False))
    assert la._fla_layout_ok(torch.device("cpu"), 2, 16, 8, *[torch.float32] * 3) == want


@pytest.mark.parametrize("capability, above_3_4, above_3_7_1, broken", [
    ((9, 0), True, False, True), ((9, 0), True, True, False), ((9, 0), False, False, False),
    ((8, 0), True, False, False), ((10, 0), True, False, False)])
def test_the_refusal_is_hoppers_with_flas_broken_tritons(monkeypatch, capability, above_3_4, above_3_7_1, broken):
    from lathe.models import linear_attention as la
    chunk_o, _, _ = _fake_fla(monkeypatch)
    chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = above_3_4, above_3_7_1
    monkeypatch.setattr(la, "nvidia_capability", lambda device: capability)
    assert la._broken_triton(torch.device("cpu")) is broken


def test_the_layout_check_runs_inside_a_checkpointed_training_forward(monkeypatch):
    """A hybrid model's training step with checkpointed layers, fla's chunk stood in for by the torch form and the
    lift's conditions faked on CPU: the layout's check runs once (in its thread, beside the checkpoint's saved-tensor
    hooks: run on the caller's thread it fails with a CheckpointError), not again in the recompute, and the step's
    gradients stay the torch form's (the stand-in is the torch form: what this guards is that the check leaves the
    checkpointed step undisturbed)."""
    from lathe.models import linear_attention as la
    from lathe.models.hf import lathe_from_transformers
    from lathe.models.packing import pack_padded

    from .lathe_tiny import hf_model, ragged_batch
    model = lathe_from_transformers(hf_model("qwen3_5_text")).train()
    packed = pack_padded(*ragged_batch(1))

    def grads():
        model.zero_grad()
        model.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                             return_hidden=False).pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want = grads()
    checks, real_check = [], la._fla_layout_ok
    monkeypatch.setattr(la, "_on_cuda", lambda x: True)
    monkeypatch.setattr(la, "fla_ops", lambda: ("chunk", "recurrent"))
    monkeypatch.setattr(la, "_broken_triton", lambda device: True)
    monkeypatch.setattr(la, "_lift_fla_guard", lambda: True)
    monkeypatch.setattr(la, "SAFE_KEY_TILE_ABOVE", 4)          # the tiny model's 8-wide key heads count as wide
    monkeypatch.setattr(la, "_CHECKED", {})
    monkeypatch.setattr(la, "CHECK_LENGTHS", (1, 64, 200, 77))                  # (a short check will do here)
    monkeypatch.setattr(la, "_fla_chunk", lambda q, k, v, g, beta, cu, initial: la._torch_chunk(
        q, k, v, g, beta, cu, int((cu[1:] - cu[:-1]).max()), initial))
    monkeypatch.setattr(la, "_fla_layout_ok", lambda *layout: checks.append(layout) or real_check(*layout))
    model.model.gradient_checkpointing = True
    got = grads()
    assert checks == [(torch.device("cpu"), 4, 8, 8, *[torch.float32] * 3)] and la._CHECKED == {checks[0]: (True, True)}
    assert_close_rel(got, want, rel=1e-6, name="gradients")
