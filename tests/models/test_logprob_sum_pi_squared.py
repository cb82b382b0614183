"""sum_v p_v^2 (the optimal token baseline's input) from the chunked log-prob pass, against float64 softmax."""

import pytest
import torch

from lathe.models.logprob import chunked_log_probs, chunked_token_stats

from helpers import assert_close_rel


@pytest.mark.parametrize("chunk_size", [1, 8, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sum_pi_squared_matches_softmax_and_leaves_the_rest_unchanged(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=gen).requires_grad_()
    w = (torch.randn(50, 16, generator=gen) * 2.0).requires_grad_()      # peaked: sum p^2 spans (0, 1)
    t = torch.randint(0, 50, (37,), generator=gen)
    logp, ent, sum_sq = chunked_token_stats(h, w, t, temperature=temperature, chunk_size=chunk_size,
                                            calculate_entropy=True, calculate_sum_pi_squared=True)
    probs = torch.softmax((h.detach().double() @ w.detach().double().t()) / temperature, dim=-1)
    assert_close_rel(sum_sq, (probs ** 2).sum(-1), rel=1e-5, name="sum p^2")
    assert not sum_sq.requires_grad and sum_sq.min() > 0 and sum_sq.max() <= 1
    plain_logp, plain_ent = chunked_log_probs(h, w, t, temperature=temperature, chunk_size=chunk_size,
                                              calculate_entropy=True)
    assert torch.equal(logp, plain_logp) and torch.equal(ent, plain_ent)
    (logp.sum() + ent.sum()).backward()                                  # the extra output costs no gradient
    assert torch.isfinite(h.grad).all()


def test_sum_pi_squared_is_none_unless_asked():
    h, w, t = torch.randn(5, 4), torch.randn(7, 4), torch.randint(0, 7, (5,))
    assert chunked_token_stats(h, w, t)[2] is None
