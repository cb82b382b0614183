"""GPT-OSS's attention options on the flash kernel (`lathe.models.sink_flash`): the sinks folded into flash
attention's output and log-sum-exp, its backward handed the sinked output and log-sum-exp, the sink's own gradient
apart. On the CPU with a reference core of the flash ops' contract (float64) against the explicit softmax
(`sink_attention`); on a GPU the flash ops themselves, at GPT-OSS-20B's head layout."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_rel
from lathe.models import sink_flash
from lathe.models.attention import PackedAttention, sink_attention, window_mask

LENGTHS = (7, 1, 12, 0, 5)          # one sequence of one token, one empty, one longer than the window


def _segments(cu_q, cu_k, device, end=True):
    """Each sequence's query and key bounds, and the causal, windowed mask's positions (queries the last of the
    keys; `end` False: the first, a kernel aligned at the start)."""
    qb, kb = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        first = d - c - (b - a) if end else 0
        yield a, b, c, d, torch.arange(first, first + b - a, device=device), torch.arange(d - c, device=device)


def reference_core(q, k, v, cu_q, cu_k, max_q, max_k, window, scale, end=True):
    """`sink_flash.flash_core`'s contract in plain torch (the CPU tests' core): out (T, Hq, D) and lse (Hq, T)
    float32 of causal, windowed attention within each sequence (aligned at its end where it has fewer queries than
    keys), K/V at their own (grouped) head count."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b, c, d, qpos, kpos in _segments(cu_q, cu_k, q.device, end):
        qs = q[a:b].transpose(0, 1)                                        # (H, L, D)
        ks, vs = (x[c:d].transpose(0, 1).repeat_interleave(groups, 0) for x in (k, v))
        s = (qs.double() @ ks.double().transpose(-1, -2)) * scale
        s = s.masked_fill(~window_mask(qpos, kpos, window), float("-inf"))
        lse = torch.logsumexp(s, -1)                                       # (H, L)
        outs.append((torch.exp(s - lse[..., None]) @ vs.double()).transpose(0, 1).to(q.dtype))
        lses.append(lse.float())
    return torch.cat(outs, 0), torch.cat(lses, 1), None


def reference_core_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, window, scale, state, end=True):
    """Flash attention's backward in plain torch: P = exp(s - lse) from the lse handed in, D = rowsum(dout * out)
    from the output handed in (the two things `flash_sink_attention` relies on)."""
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, c, d, qpos, kpos in _segments(cu_q, cu_k, q.device, end):
        qs, do, o = (x[a:b].transpose(0, 1).double() for x in (q, dout, out))
        ks, vs = (x[c:d].transpose(0, 1).double().repeat_interleave(groups, 0) for x in (k, v))
        s = (qs @ ks.transpose(-1, -2)) * scale
        s = s.masked_fill(~window_mask(qpos, kpos, window), float("-inf"))
        p = torch.exp(s - lse[:, a:b, None].double())
        dp = do @ vs.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True)) * scale
        dq[a:b] = (ds @ ks).transpose(0, 1).to(q.dtype)
        dks, dvs = ds.transpose(-1, -2) @ qs, p.transpose(-1, -2) @ do    # (Hq, L, D)
        h = k.shape[1]
        dk[c:d] = dks.view(h, groups, *dks.shape[1:]).sum(1).transpose(0, 1).to(k.dtype)
        dv[c:d] = dvs.view(h, groups, *dvs.shape[1:]).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


def explicit(q, k, v, sinks, cu, window):
    outs, bounds = [], cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        pos = torch.arange(end - start, device=q.device)
        outs.append(sink_attention(qs, ks, vs, window_mask(pos, pos, window), sinks)[0].transpose(0, 1))
    return torch.cat(outs, 0)


def inputs(heads=4, kv_heads=2, dim=8, dtype=torch.float64, device="cpu", lengths=LENGTHS, sinks=True, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g, device=device).to(dtype) for h in (heads, kv_heads, kv_heads))
    s = (torch.randn(heads, generator=g, device=device) * 2).to(dtype) if sinks else None
    grad = torch.randn(total, heads, dim, generator=g, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, s, cu, grad


def value_and_grads(fn, q, k, v, s, grad, dtype=None):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v, *([s] if s is not None else []))]
    out = fn(*leaves[:3], leaves[3] if s is not None else None)
    return [out, *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_sinks_folded_into_the_flash_contract_equal_the_explicit_softmax(window, sinks, kv_heads):
    q, k, v, s, cu, grad = inputs(kv_heads=kv_heads, sinks=sinks)
    got = value_and_grads(lambda *a: sink_flash.flash_sink_attention(
        *a, cu, max(LENGTHS), window, core=reference_core,
        core_backward=reference_core_backward), q, k, v, s, grad)
    want = value_and_grads(lambda *a: explicit(*a, cu, window), q, k, v, s, grad)
    # (the explicit form computes in float32: its rounding, not the method's, sets the floor)
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
        assert_close_rel(a, b, 1e-5, name=name)


def test_packed_attention_takes_the_flash_path_only_where_its_check_passed(monkeypatch):
    """On the "varlen" backend a GPT-OSS layer's options go to `flash_sink_attention` once `flash_sinks_agree`
    passed for the layout (here faked, with the reference core standing in for the flash ops); where it failed, the
    explicit softmax runs; either way the same result."""
    from lathe.models import attention
    q, k, v, s, cu, grad = inputs()
    calls = []
    monkeypatch.setattr(sink_flash, "flash_core", lambda *a: calls.append(1) or reference_core(*a))
    monkeypatch.setattr(sink_flash, "flash_core_backward", reference_core_backward)
    monkeypatch.setattr(attention, "varlen_takes_gqa", lambda index, dtype: True)
    want = value_and_grads(lambda *a: explicit(*a, cu, 4), q, k, v, s, grad)
    for agree in (True, False):
        monkeypatch.setattr(sink_flash, "flash_sinks_agree", lambda *a, agree=agree: agree)
        calls.clear()
        attn = PackedAttention(cu, max(LENGTHS), backend="varlen")
        got = value_and_grads(lambda q, k, v, s: attn(q, k, v, sinks=s, window=4), q, k, v, s, grad)
        assert bool(calls) == agree
        for a, b in zip(got, want):
            assert_close_rel(a, b, 1e-5)


def test_the_one_time_check_passes_a_right_kernel_and_catches_a_window_one_key_wide():
    """`check_errors` (what `flash_sinks_agree` runs on a GPU) on the CPU with the reference core in bfloat16: within
    AGREEMENT at GPT-OSS's window and none; a core whose window is one key wider fails it, even asked at 128."""
    def wide(q, k, v, cu_q, cu_k, max_q, max_k, window, scale):
        return reference_core(q, k, v, cu_q, cu_k, max_q, max_k, window + 1, scale)

    def wide_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, window, scale, state):
        return reference_core_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, window + 1, scale, state)

    right = dict(core=reference_core, core_backward=reference_core_backward)
    for at_end in (False, True):            # (at_end: fewer queries than keys, the prefix-grouped forward's layout)
        for window in (None, 128):
            errs = sink_flash.check_errors("cpu", torch.bfloat16, 4, 2, 16, window, True, at_end=at_end, **right)
            assert max(errs.values()) <= sink_flash.AGREEMENT, errs
        errs = sink_flash.check_errors("cpu", torch.bfloat16, 4, 2, 16, 128, True, at_end=at_end, core=wide,
                                       core_backward=wide_backward)
        assert errs["output"] > sink_flash.AGREEMENT, errs


def test_a_misaligned_kernel_fails_the_check_at_the_end():
    """A core that aligns each sequence's causal mask at its start where it has fewer queries than keys (flash
    attention before 2.1) fails the check of the end-aligned layout, and passes the packed one."""
    def at_start(*args):
        return reference_core(*args, end=False)

    def at_start_backward(*args):
        return reference_core_backward(*args, end=False)
    wrong = dict(core=at_start, core_backward=at_start_backward)
    assert max(sink_flash.check_errors("cpu", torch.float32, 4, 2, 16, 128, True, **wrong).values()) <= 1e-5
    assert sink_flash.check_errors("cpu", torch.float32, 4, 2, 16, 128, True, at_end=True, **wrong)["output"] > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128, 3])
def test_flash_kernel_passes_its_check_at_gpt_oss_20bs_layout_and_matches_the_explicit_form(window):
    """64 query heads over 8 K/V heads of 64, sinks, the 128-token window and full layers, bf16: the one-time check
    passes, and on a longer packed batch the flash path's output and gradients are the float32 explicit form's."""
    assert sink_flash.flash_sinks_agree(0, torch.bfloat16, 64, 8, 64, window, True)
    assert sink_flash.flash_sinks_agree(0, torch.bfloat16, 64, 8, 64, window, True, True)    # (the grouped layout)
    q, k, v, s, cu, grad = inputs(64, 8, 64, torch.bfloat16, "cuda", lengths=(300, 17, 768, 1, 200), seed=1)
    lengths = (cu[1:] - cu[:-1]).tolist()
    got = value_and_grads(lambda *a: sink_flash.flash_sink_attention(*a, cu, max(lengths), window), q, k, v, s, grad)
    want = value_and_grads(lambda *a: explicit(*a, cu, window), q, k, v, s, grad, dtype=torch.float32)
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
        assert_close_rel(a.float(), b, 2e-2, name=name)
