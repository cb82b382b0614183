"""Tests for lathe.engine.sampler: top-k/top-p masks, greedy, min_tokens, log-probs at temperature."""

import math

import torch

from lathe.engine.sampler import apply_top_k_top_p, sample
from lathe.engine.sequence import Sequence, SequenceParams


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    kept = torch.isfinite(apply_top_k_top_p(logits, 2, 1.0))
    assert kept.tolist() == [False, True, False, True]


def test_rows_with_and_without_top_k_in_one_batch():
    """A row without top-k (k = -1) beside one with it: each keeps its own set, whether the device is asked
    which rows use top-k or the caller says so (the engine's sampler does, to avoid waiting for the device)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 2.0, 3.0]])
    k = torch.tensor([2, -1, 3])
    for flags in ({}, {"use_k": True, "k_max": 4, "use_p": False}):
        kept = torch.isfinite(apply_top_k_top_p(logits, k, torch.ones(3), **flags))
        assert kept.tolist() == [[False, True, False, True], [True] * 4, [True, False, True, True]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    kept = torch.isfinite(apply_top_k_top_p(probs.log(), -1, 0.7))
    assert kept.tolist() == [False, True, False, True]      # 0.5 + 0.25 >= 0.7
    assert torch.isfinite(apply_top_k_top_p(probs.log(), -1, 0.01)).sum() == 1


def test_greedy_min_tokens_and_logprob_temperature():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    stop = SequenceParams(temperature=0, min_tokens=1, stop_token_ids=frozenset({1}))
    tok, lp = sample(logits, [Sequence([5], stop)])
    assert tok == [2]                                         # the stop id is banned before min_tokens
    assert math.isclose(lp[0], float(torch.log_softmax(logits[0], -1)[2]), abs_tol=1e-6)
    params = SequenceParams(temperature=0.5, top_k=1)
    tok, lp = sample(logits, [Sequence([5], params, 0)])
    assert tok == [1] and math.isclose(lp[0], float(torch.log_softmax(logits[0] / 0.5, -1)[1]), abs_tol=1e-6)


def test_per_sequence_draws_do_not_depend_on_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SequenceParams(temperature=1.0)

    def draw(rows):
        seqs = [Sequence([1], params, 10 + r) for r in rows]
        out = []
        for _ in range(5):
            out.append(sample(logits[rows], seqs)[0])
            for s, t in zip(seqs, out[-1]):
                s.append_token(t, 0.0)
        return out

    alone = draw([1])
    together = draw([0, 1, 2])
    assert [t[0] for t in alone] == [t[1] for t in together]
    assert len({t[1] for t in together}) > 1


def test_sampling_frequencies_follow_the_warped_distribution():
    """Many seeds, one step: the empirical frequencies match softmax(top-k/top-p(logits / T))."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SequenceParams(temperature=0.7, top_k=4, top_p=0.9)
    draws = 4000
    tokens, _ = sample(logits.expand(draws, -1), [Sequence([1], params, s) for s in range(draws)])
    freq = torch.bincount(torch.tensor(tokens), minlength=6).float() / draws
    expect = apply_top_k_top_p(logits[0] / 0.7, 4, 0.9).softmax(-1)
    assert expect[4:].sum() == 0 and freq[4:].sum() == 0         # outside the top-k/top-p sets never drawn
    assert torch.allclose(freq, expect, atol=0.025), (freq, expect)


def test_mixed_rows_equal_rows_sampled_alone():
    """A batch mixing greedy, top-k, top-p and min_tokens rows gives each row what it gets alone."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    params = [SequenceParams(temperature=0), SequenceParams(temperature=1.3, top_k=5),
              SequenceParams(temperature=0.8, top_p=0.6),
              SequenceParams(temperature=1.0, min_tokens=2, stop_token_ids=frozenset({int(logits[3].argmax())}))]
    seqs = [Sequence([1], p, None if p.greedy else 100 + i) for i, p in enumerate(params)]
    together = sample(logits, seqs)
    for i, seq in enumerate(seqs):
        tok, lp = sample(logits[i:i + 1], [seq])
        assert tok[0] == together[0][i]
        assert math.isclose(lp[0], together[1][i], abs_tol=1e-6)
        t = params[i].logprob_temperature
        assert math.isclose(lp[0], float(torch.log_softmax(logits[i] / t, -1)[tok[0]]), abs_tol=1e-6)
    assert together[0][3] not in params[3].stop_token_ids


def _splitmix_reference(seed: int, position: int) -> float:
    """splitmix64 written with Python integers and explicit 64-bit masks: the reference for `uniforms`."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def test_vectorised_uniforms_equal_the_python_integer_hash():
    from lathe.engine.sampler import uniforms
    seeds, positions = [0, 1, 2**62 + 5, 123456789], [0, 7, 3, 100000]
    assert uniforms(seeds, positions).tolist() == [_splitmix_reference(s, p) for s, p in zip(seeds, positions)]
    draws = uniforms([0] * 100, list(range(100)))
    assert len(set(draws.tolist())) == 100 and ((0 <= draws) & (draws < 1)).all()


def test_ties_are_kept_or_dropped_whole():
    """Three tokens tie at the k-th largest value, and top-p's cut falls inside the same tie group: all three are
    kept either way (a sort's order among them decides nothing)."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [True] * 4 + [False]
    # mass above the 1.0 group: e^2 / (e^2 + 3e + 1) = 0.447 < 0.5, while e^2 + e alone is 0.61 of it
    assert torch.isfinite(apply_top_k_top_p(logits, -1, 0.5)).tolist() == [True] * 4 + [False]
    assert torch.isfinite(apply_top_k_top_p(logits, -1, 0.4)).tolist() == [True] + [False] * 4


def test_kept_sets_equal_the_rule_written_out():
    """Random rows, some with ties (bf16-rounded): the PyTorch masks equal the float64 reference's kept sets."""
    from .sampling_reference import kept_reference
    g = torch.Generator().manual_seed(2)
    for trial in range(12):
        x = torch.randn(400, generator=g) * (0.5 + trial)
        if trial % 2:
            x = x.bfloat16().float()
        temperature, k, p = 0.5 + 0.1 * trial, [-1, 3, 40, 399][trial % 4], [1.0, 0.3, 0.9, 0.99][trial // 3 % 4]
        kept = torch.isfinite(apply_top_k_top_p(x / temperature, k, p)).tolist()
        assert kept == kept_reference(x.double().tolist(), temperature, k, p), (trial, k, p)
