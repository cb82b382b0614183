"""The fused sampler's top-k/top-p searches, run in Triton's CPU interpreter: the tokens it keeps against the rule
written out in float64 (`sampling_reference`), and its draws against the PyTorch sampler's, draw for draw."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import assert_close_rel  # noqa: E402
from lathe.engine.sampler import sample  # noqa: E402
from lathe.engine.sequence import Sequence, SequenceParams  # noqa: E402

from .sampling_reference import kept_reference  # noqa: E402


@pytest.fixture(scope="module")
def fused(triton_interpreter):
    """lathe.engine.triton_sample.fused_sample, its kernels run by Triton's CPU interpreter."""
    from lathe.engine.triton_sample import fused_sample
    return fused_sample


def _draw(fused, logits, params, seeds, positions, dtype, **kw):
    """The fused sampler over `logits` in `dtype`, top-k/top-p given per row as the engine gives them."""
    temps = torch.tensor([p.logprob_temperature for p in params])
    greedy = torch.tensor([int(p.greedy) for p in params], dtype=torch.int32)
    return fused(logits.to(dtype), temps, greedy, torch.tensor(seeds), torch.tensor(positions), chunk=512,
                 top_k=torch.tensor([p.top_k for p in params]), top_p=torch.tensor([p.top_p for p in params]), **kw)


def _seqs(params, seeds, positions):
    seqs = []
    for p, seed, pos in zip(params, seeds, positions):
        s = Sequence([1], p, None if p.greedy else seed)
        s.token_ids += [0] * pos                    # output position = tokens generated so far
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_searches_draw_what_the_torch_sampler_draws(fused, dtype):
    """A batch mixing top-k, top-p, both, k = 1, k >= V, greedy and plain rows over a 3000-token vocabulary cut into
    six chunks: every row draws the PyTorch sampler's token from the same uniform, inside the reference's kept set,
    with the full distribution's log-prob, for logits in bf16 (16 key bits to search), fp16 (19) and float32 (32)."""
    g = torch.Generator().manual_seed(3)
    settings = [dict(top_k=20), dict(top_p=0.8, temperature=0.7), dict(top_k=50, top_p=0.5), dict(temperature=0),
                dict(temperature=1.3), dict(top_k=1, temperature=0.9), dict(top_k=5000, top_p=0.95),
                dict(top_k=300, top_p=0.99, temperature=1.5), dict(top_p=0.05)]
    params = [SequenceParams(**{"temperature": 1.0, **s}) for s in settings] * 2
    rows = len(params)
    logits = torch.randn(rows, 3000, generator=g) * 3
    logits[2, 2999] = 25.0                                      # a peaked row: top-p keeps one token
    logits[13] -= 30.0                                          # a plain row of negative logits in a searching batch
    logits[15] -= 30.0                                          # and a top-k = 1 one
    logits = logits.to(dtype).float()                           # values the kernel's dtype holds exactly
    seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
    positions = torch.randint(0, 900, (rows,), generator=g).tolist()
    ref_tok, ref_lp = sample(logits, _seqs(params, seeds, positions))
    out = _draw(fused, logits, params, seeds, positions, dtype)
    assert out[0].long().tolist() == ref_tok
    assert_close_rel(out[1], ref_lp, name="log-probs")
    for i, p in enumerate(params):
        if not p.greedy:
            kept = kept_reference(logits[i].double().tolist(), p.temperature, p.top_k, p.top_p)
            assert kept[ref_tok[i]], (i, p)


def test_ties_at_the_threshold_are_kept_whole(fused):
    """Logits from five values, hundreds of tokens each: the k-th largest and the top-p cut fall inside tie groups,
    and every tied token is kept. Over 40 seeds the fused draws equal the PyTorch sampler's and reach tokens of the
    tie group that a sort-and-cut at exactly k tokens would drop."""
    g = torch.Generator().manual_seed(5)
    values = torch.tensor([4.0, 3.0, 2.5, 1.0, -2.0])
    row = values[torch.randint(0, 5, (2000,), generator=g)].bfloat16().float()
    count_top = int((row == 4.0).sum())
    params = [SequenceParams(top_k=count_top + 7)] * 20 + [SequenceParams(top_p=0.7)] * 20
    kept_k = kept_reference(row.double().tolist(), 1.0, count_top + 7, 1.0)
    kept_p = kept_reference(row.double().tolist(), 1.0, -1, 0.7)
    assert sum(kept_k) == int((row >= 3.0).sum()) > count_top + 7      # the whole 3.0 group
    assert sum(kept_p) == sum(kept_k)                                   # 0.7 of the mass ends inside the 3.0 group
    logits = row.expand(len(params), -1).contiguous()
    seeds, positions = list(range(100, 140)), [0] * 40
    ref_tok, _ = sample(logits, _seqs(params, seeds, positions))
    out = _draw(fused, logits, params, seeds, positions, torch.bfloat16)
    assert out[0].long().tolist() == ref_tok
    assert all(kept_k[t] for t in ref_tok)
    threes = [t for t in ref_tok if row[t] == 3.0]
    first_kept = sorted(i for i in range(2000) if row[i] == 3.0)[:7]     # a stable sort's cut at k keeps these
    assert threes and any(t not in first_kept for t in threes)


def test_search_passes_cover_the_key_space():
    """bf16 logits leave 16 of a float32 key's bits zero: the passes reach one value apart after 16 bits of
    pivots (fp16 19, float32 all 32). The first pass spans the int32 keys."""
    from lathe.engine.triton_sample import search_strides
    for np_ in (4, 8, 16):
        bits = np_.bit_length() - 1
        for dtype, step in ((torch.bfloat16, 1 << 16), (torch.float16, 1 << 13), (torch.float32, 1)):
            strides = search_strides(dtype, np_)
            assert len(strides) == -(-(32 - step.bit_length() + 1) // bits)
            assert strides[-1] <= step and strides[0] * np_ == 1 << 32
            assert all(a == b * np_ or b == 1 for a, b in zip(strides, strides[1:]))
