"""Tests for lathe.engine.sampler: top-k/top-p masks, greedy, min_tokens, log-probs at temperature."""

import math

import torch

from lathe.engine.sampler import apply_top_k_top_p, sample
from lathe.engine.sequence import Sequence, SequenceParams


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    kept = torch.isfinite(apply_top_k_top_p(logits, 2, 1.0))
    assert kept.tolist() == [False, True, False, True]


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
    tok, lp = sample(logits, [Sequence([5], params, torch.Generator().manual_seed(0))])
    assert tok == [1] and math.isclose(lp[0], float(torch.log_softmax(logits[0] / 0.5, -1)[1]), abs_tol=1e-6)


def test_per_sequence_generator_draws_do_not_depend_on_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SequenceParams(temperature=1.0)

    def draw(rows):
        seqs = [Sequence([1], params, torch.Generator().manual_seed(10 + r)) for r in rows]
        return [sample(logits[rows], seqs)[0] for _ in range(5)]

    alone = draw([1])
    together = draw([0, 1, 2])
    assert [t[0] for t in alone] == [t[1] for t in together]
    assert len({t[1] for t in together}) > 1
