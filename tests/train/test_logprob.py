"""Tests for lathe.train.logprob: response log-probs and entropy against a per-sequence manual forward."""

import pytest
import torch

from lathe.models.hf import lathe_from_transformers
from lathe.train.logprob import batched_log_probs, response_log_probs
from lathe.train.micro import HOST_MASK, micro_batches, with_host_mask

from helpers import assert_close_rel


@torch.no_grad()
def _manual(model, batch, row, temperature):
    """(log-probs, entropy) of row `row`'s real response tokens from a forward over its unpadded tokens."""
    prompt = batch["prompts"][row][batch["attention_mask"][row, :batch["prompts"].shape[1]].bool()]
    n = int(batch["response_mask"][row].sum())
    response = batch["responses"][row, :n]
    ids = torch.cat([prompt, response])[None]
    logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, response[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("impl", ["hf", "lathe-padded", "lathe-packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_response_log_probs_match_manual_forward(make_model, rollout_batch, temperature, impl):
    """transformers' full logits and lathe's chunked path (padded or packed forward) give the same numbers as
    a forward of each row alone through the transformers model."""
    model, batch = make_model().eval(), rollout_batch()
    run = lathe_from_transformers(model).eval() if impl.startswith("lathe") else model
    with torch.no_grad():
        logp, ent = response_log_probs(run, batch, temperature=temperature, calculate_entropy=True,
                                       remove_padding=impl == "lathe-packed", chunk_size=5)
    assert logp.shape == ent.shape == batch["responses"].shape
    for row in range(len(batch)):
        m_logp, m_ent = _manual(model, batch, row, temperature)
        n = len(m_logp)
        assert_close_rel(logp[row, :n], m_logp, name=f"log-probs of row {row}")
        assert_close_rel(ent[row, :n], m_ent, name=f"entropy of row {row}")
        if impl == "lathe-packed":
            assert torch.all(logp[row, n:] == 0) and torch.all(ent[row, n:] == 0), "padding holds 0"


def test_lathe_packed_gradients_equal_padded(make_lathe, rollout_batch):
    """The packed forward (use_remove_padding) gives the padded forward's gradients, entropy included."""
    batch = rollout_batch(seed=4)
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    grads = {}
    for packed in (False, True):
        model = make_lathe()
        logp, ent = response_log_probs(model, batch, temperature=0.7, calculate_entropy=True, remove_padding=packed)
        ((logp + 0.1 * ent) * weights * batch["response_mask"]).sum().backward()
        grads[packed] = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert grads[False]["model.embed_tokens.weight"].abs().sum() > 0
    assert_close_rel(grads[True], grads[False], name="packed gradients")


def test_packed_rejects_a_response_after_padding(make_lathe, rollout_batch):
    batch = rollout_batch(rows=2)
    batch["attention_mask"][0, batch["prompts"].shape[1] - 1] = 0   # the token before the response is padding
    for b in (batch, with_host_mask(batch)):
        with pytest.raises(ValueError, match="follows a padding position"):
            response_log_probs(make_lathe(), b, remove_padding=True)


def test_packed_layout_from_the_host_mask_gives_the_same_numbers_and_gradients(make_lathe, rollout_batch):
    """Micro-batches carry a host copy of the mask (`with_host_mask`); the packing and response positions worked
    out from it (`host_layout`, no device sync) give exactly what the device-side packing gives, in value and
    gradient, for the actor (log-probs, entropy) and the critic's hidden states."""
    from lathe.train.logprob import host_layout, response_hidden
    batch = rollout_batch(seed=5)
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for host in (False, True):
        b = with_host_mask(batch) if host else batch
        assert (host_layout(b) is not None) == host
        model = make_lathe()
        logp, ent = response_log_probs(model, b, temperature=0.7, calculate_entropy=True, remove_padding=True)
        ((logp + 0.1 * ent) * weights * batch["response_mask"]).sum().backward()
        with torch.no_grad():
            hidden, valid = response_hidden(model, b, remove_padding=True)
        results[host] = (logp, ent, hidden, valid, {k: p.grad.clone() for k, p in model.named_parameters()})
    for a, b in zip(results[True], results[False]):
        if isinstance(a, dict):
            assert_close_rel(a, b, name="gradients")
        else:
            assert torch.equal(a, b)
    parts = micro_batches(batch, size=3)
    assert all(HOST_MASK in mb for mb, _ in parts) and torch.equal(
        torch.cat([mb[HOST_MASK] for mb, _ in parts]), batch["attention_mask"])


def test_entropy_off_by_default_and_gradients_flow(make_model, rollout_batch):
    model, batch = make_model(), rollout_batch(rows=2)
    logp, ent = response_log_probs(model, batch)
    assert ent is None
    (logp * batch["response_mask"]).sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_batched_log_probs_match_one_pass_and_restore_mode(make_model, rollout_batch):
    model, batch = make_model().train(), rollout_batch(rows=7)
    with torch.no_grad():
        full, full_ent = response_log_probs(model.eval(), batch, temperature=0.8, calculate_entropy=True)
    model.train()
    logp, ent = batched_log_probs(model, batch, micro_batch_size=3, temperature=0.8, calculate_entropy=True)
    assert model.training
    assert not logp.requires_grad
    mask = batch["response_mask"].bool()
    assert_close_rel(logp[mask], full[mask], name="log-probs")
    assert_close_rel(ent[mask], full_ent[mask], name="entropy")
    logp2, ent2 = batched_log_probs(model, batch, micro_batch_size=100)
    assert ent2 is None and logp2.shape == full.shape
    # packed by a token budget: rows regrouped across micro-batches, returned in the batch's order
    logp3, ent3 = batched_log_probs(model, batch, micro_batch_size=1, max_tokens=12, temperature=0.8,
                                   calculate_entropy=True)
    assert_close_rel(logp3[mask], full[mask], name="token-packed log-probs")
    assert_close_rel(ent3[mask], full_ent[mask], name="token-packed entropy")
