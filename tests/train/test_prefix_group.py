"""Prefix-grouped forward (actor.use_prefix_grouper): the same log-probs, entropies and gradients as the padded
forward of every row alone, with each prompt computed once."""

import pytest
import torch

from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train.logprob import batched_token_stats, response_log_probs
from lathe.train.prefix_group import grouped_layout

from helpers import assert_close_rel

from .conftest import PAD, VOCAB


def _grouped_batch(n=3, seed=0, shuffle=True):
    """3 prompts x n ragged responses, rows shuffled (a shuffled mini-batch keeps no group together)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in (3, 5, 2)]
    responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(len(prompts) * n)]
    batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * len(responses)),
                     PAD, n=n)
    if shuffle:
        batch = batch.select(torch.randperm(len(batch), generator=g).tolist())
    return batch


def test_layout_runs_each_prompt_once():
    batch = _grouped_batch()
    layout = grouped_layout(batch)
    assert layout.input_ids.shape[0] == 3                                  # three prompts, nine rows
    responses = int(batch["response_mask"].sum())
    assert layout.source.numel() == responses
    assert int((layout.input_ids != PAD).sum()) == (3 + 5 + 2) + responses      # prompts once, every response
    seen = layout.attn_mask[:, 0]
    assert torch.equal(seen, seen & torch.ones_like(seen).tril())                # causal


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grouped_equals_padded_in_value_and_gradient(make_lathe, temperature):
    batch = _grouped_batch()
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    out, grads = {}, {}
    for grouped in (False, True):
        model = make_lathe()
        logp, ent = response_log_probs(model, batch, temperature=temperature, calculate_entropy=True,
                                       prefix_grouper=grouped, chunk_size=4)
        ((logp + 0.1 * ent) * weights * batch["response_mask"]).sum().backward()
        out[grouped] = (logp.detach(), ent.detach())
        grads[grouped] = {k: p.grad.clone() for k, p in model.named_parameters()}
    mask = batch["response_mask"].bool()
    assert_close_rel(out[True][0][mask], out[False][0][mask], name="log-probs")
    assert_close_rel(out[True][1][mask], out[False][1][mask], name="entropy")
    assert torch.all(out[True][0][~mask] == 0)
    assert_close_rel(grads[True], grads[False], name="gradients")


def test_batched_grouped_with_sum_pi_squared(make_lathe):
    batch = _grouped_batch(seed=3)
    model = make_lathe().eval()
    plain = batched_token_stats(model, batch, micro_batch_size=4, calculate_sum_pi_squared=True)
    grouped = batched_token_stats(model, batch, micro_batch_size=4, calculate_sum_pi_squared=True,
                                  prefix_grouper=True)            # micro-batches cut groups: each part groups alone
    mask = batch["response_mask"].bool()
    for name, a, b in zip(("log-probs", "sum p^2"), (grouped[0], grouped[2]), (plain[0], plain[2])):
        assert_close_rel(a[mask], b[mask], name=name)


def test_grouping_needs_lathes_decoder(make_model):
    with pytest.raises(ValueError, match="use_prefix_grouper=true needs lathe's text decoder"):
        response_log_probs(make_model(), _grouped_batch(), prefix_grouper=True)
