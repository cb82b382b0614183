"""Chunked log-prob/entropy: equal to the naive full-logits computation, with memory bounded by the chunk."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lathe.models import load_lathe_model
from lathe.models.logprob import chunked_log_probs, naive_log_probs, response_log_probs

from helpers import assert_close_rel

from .lathe_tiny import save_hf


def _inputs(n=37, hidden=16, vocab=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, t


def _value_and_grads(fn, h, w, t, **kw):
    h.grad = w.grad = None
    logp, ent = fn(h, w, t, **kw)
    coef = torch.linspace(-1, 1, logp.numel(), device=logp.device).view_as(logp)
    loss = (logp * coef).sum() + (0.3 * ent.sum() if ent is not None else 0)
    loss.backward()
    return logp.detach(), (ent.detach() if ent is not None else None), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_equals_naive_in_value_and_gradient(chunk_size, temperature, entropy):
    h, w, t = _inputs()
    kw = dict(temperature=temperature, calculate_entropy=entropy)
    ours = _value_and_grads(chunked_log_probs, h, w, t, chunk_size=chunk_size, **kw)
    ref = _value_and_grads(naive_log_probs, h, w, t, **kw)
    for name, a, b in zip(("log-probs", "entropy", "grad h", "grad w"), ours, ref):
        if b is None:
            assert a is None
        else:
            assert_close_rel(a, b, name=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_weight_gradient_accumulates_in_float32_in_one_gemm_on_cuda():
    """bf16 hidden states and weight on CUDA: the chunks' weight gradients go into the float32 accumulator inside
    the GEMM (no bf16 product per chunk), and value and gradients match a float32 full-logits reference."""
    from lathe.models.logprob import _accumulates_in_place
    assert _accumulates_in_place("cuda")
    h32, w32, t = _inputs(n=1000, hidden=64, vocab=3000)
    h = h32.detach().cuda().bfloat16().requires_grad_()
    w = w32.detach().cuda().bfloat16().requires_grad_()
    ours = _value_and_grads(chunked_log_probs, h, w, t.cuda(), chunk_size=128, calculate_entropy=True)
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = _value_and_grads(naive_log_probs, hr, wr, t.cuda(), calculate_entropy=True)
    for name, a, b in zip(("log-probs", "entropy", "grad h", "grad w"), ours, ref):
        assert_close_rel(a.float(), b, 2e-2, name=name)


@pytest.mark.parametrize("used", ["log-probs", "entropy"])
def test_an_output_the_loss_does_not_use_costs_no_gradient_pass(monkeypatch, used):
    """The actor computes the entropy for its metric and detaches it when entropy_coeff=0: the backward must then
    skip the entropy term (autograd hands the function None, not zeros); with only the entropy in the loss, the
    log-prob term is zero. Gradients equal the naive reference either way."""
    from lathe.models import logprob
    seen = []
    spy = lambda *a: seen.append(a[6]) or logprob._chunk_grad(*a)  # noqa: E731
    monkeypatch.setattr(logprob, "_chunk_ops", lambda backend: (logprob._chunk_forward, spy))
    h, w, t = _inputs()
    grads = []
    for fn in (chunked_log_probs, naive_log_probs):
        h.grad = w.grad = None
        logp, ent = fn(h, w, t, calculate_entropy=True)
        (logp.sum() + ent.detach().sum() if used == "log-probs" else ent.sum() + 0 * logp.detach().sum()).backward()
        grads.append((h.grad.clone(), w.grad.clone()))
    assert seen and all((g is None) == (used == "log-probs") for g in seen)
    for name, a, b in zip(("grad h", "grad w"), *grads):
        assert_close_rel(a, b, name=name)


def test_gradcheck_in_float64():
    h, w, t = _inputs(n=6, hidden=4, vocab=7, dtype=torch.float64)
    fn = lambda h, w: chunked_log_probs(h, w, t, temperature=0.7, chunk_size=4, calculate_entropy=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, w))


def test_temperature_divides_the_logits():
    h, w, t = _inputs()
    hot = chunked_log_probs(h, w, t, temperature=2.0)[0]
    assert torch.allclose(hot, chunked_log_probs(h / 2.0, w, t)[0], atol=1e-6)
    assert not torch.allclose(hot, chunked_log_probs(h, w, t)[0], atol=1e-3)


def test_any_leading_shape_and_bad_inputs():
    h, w, t = _inputs(n=12)
    lp, _ = chunked_log_probs(h.view(3, 4, -1), w, t.view(3, 4), chunk_size=5)
    assert lp.shape == (3, 4)
    assert_close_rel(lp.flatten(), naive_log_probs(h, w, t)[0])
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs(h, w, t, temperature=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_log_probs(h, w, t[:-1])


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (deterministic, unlike timing)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.max_numel = max(self.max_numel, x.numel())
        return out


def _largest(fn, n, vocab, hidden=4, **kw):
    h, w, t = _inputs(n=n, hidden=hidden, vocab=vocab)
    with _LargestTensor() as probe:
        logp, ent = fn(h, w, t, calculate_entropy=True, **kw)
        (logp.sum() + ent.sum()).backward()
    return probe.max_numel


def test_peak_memory_grows_with_the_chunk_not_with_tokens_times_vocab():
    n, vocab = 512, 1000
    naive = _largest(naive_log_probs, n, vocab)
    small = _largest(chunked_log_probs, n, vocab, chunk_size=16)
    large = _largest(chunked_log_probs, n, vocab, chunk_size=128)
    more_tokens = _largest(chunked_log_probs, 4 * n, vocab, chunk_size=16)
    assert naive >= n * vocab                  # the probe sees the full logits when they exist
    assert small <= 16 * vocab and large <= 128 * vocab
    assert large > small                       # grows with the chunk ...
    assert more_tokens == small                # ... and not with the number of tokens (4n x hidden < 16 x vocab)
    assert naive >= 4 * large


def test_response_log_probs_equal_a_full_logits_forward(tmp_path):
    """The chunked response path against log_softmax over the model's whole padded logits (computed here)."""
    from .lathe_tiny import ragged_batch
    path, _ = save_hf(tmp_path, "qwen2", tie=True)
    ids, mask, pos = ragged_batch(4, max_len=16)
    responses = ids[:, -6:]
    results = []
    for chunked in (True, False):
        model = load_lathe_model(path)
        if chunked:
            lp, ent = response_log_probs(model, ids, mask, pos, responses, temperature=0.8, chunk_size=5,
                                         calculate_entropy=True)
        else:
            logits = model(ids, attention_mask=mask, position_ids=pos).logits[:, -7:-1].float() / 0.8
            logp_all = torch.log_softmax(logits, dim=-1)
            lp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
        resp_mask = mask[:, -6:]
        ((lp * resp_mask).sum() - 0.1 * (ent * resp_mask).sum()).backward()
        results.append(((lp * resp_mask).detach(), (ent * resp_mask).detach(),
                        torch.cat([p.grad.flatten() for p in model.parameters()])))
    for name, a, b in zip(("log-probs", "entropy", "gradients"), *results):
        assert_close_rel(a, b, name=name)
    assert results[0][2].abs().sum() > 0


@pytest.mark.parametrize("entropy", [False, True])
def test_a_compiled_chunk_gradient_is_one_pass_over_the_logits(entropy):
    """The backward's elementwise work per chunk (softmax, the target's one-hot, the entropy term, the cast) fuses
    into one kernel after the logits' GEMM: a scatter_add_ had split it in two around a float32 copy of the chunk
    (two extra passes over chunk x vocabulary per chunk on an H100). Checked with inductor's CPU code, whose fusion
    decisions are the CUDA backend's."""
    import re
    from torch._inductor.utils import run_and_get_code
    from lathe.models.logprob import _chunk_grad
    torch._dynamo.reset()
    n, hidden, vocab = 16, 8, 300
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    t = torch.randint(0, vocab, (n,), generator=gen)
    lse, mean_z, g = (torch.randn(n, generator=gen) for _ in range(3))
    g_ent = torch.randn(n, generator=gen) if entropy else None
    try:
        out, code = run_and_get_code(torch.compile(_chunk_grad), h, w, t, lse, mean_z, g, g_ent, 0.7)
    finally:
        torch._dynamo.reset()                   # leave no compiled variant of the shared function behind
    kernels = set(re.findall(r"cpp_fused\w+", "\n".join(code)))
    assert len(kernels) == 1, kernels
    assert_close_rel(out, _chunk_grad(h, w, t, lse, mean_z, g, g_ent, 0.7), 1e-5)
