"""Tests for lathe.train.sft: the SFT batch layout, the response-only loss and `supervised_fit`."""

import random

import numpy as np
import torch

from lathe.train.sft import sft_batch, sft_loss, supervised_fit

from helpers import assert_close_rel

from .conftest import PAD

EXAMPLES = [([5, 6, 7], [10, 11, 1]), ([8, 9], [12, 1]), ([5, 13, 14, 15], [16, 17, 18, 1])]


def test_sft_batch_layout():
    b = sft_batch([p for p, _ in EXAMPLES], [r for _, r in EXAMPLES], PAD)
    assert b["prompts"][1].tolist() == [PAD, PAD, 8, 9]
    assert b["responses"][1].tolist() == [12, 1, PAD, PAD]
    assert b["response_mask"].sum(-1).tolist() == [3, 2, 4]


def test_sft_loss_is_mean_nll_over_response_tokens_only(make_model):
    model = make_model().eval()
    b = sft_batch([p for p, _ in EXAMPLES], [r for _, r in EXAMPLES], PAD)
    nll, count = 0.0, 0
    with torch.no_grad():
        loss = sft_loss(model, b)
        for p, r in EXAMPLES:
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
            nll -= torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(r)[:, None]).sum().item()
            count += len(r)
    assert_close_rel(loss.item(), nll / count, name="loss")


def test_supervised_fit_memorises_and_is_deterministic(make_model):
    kw = dict(steps=20, lr=2e-2, batch_size=3, pad_id=PAD, seed=7, device=torch.device("cpu"))
    model = make_model()
    losses = supervised_fit(model, EXAMPLES, **kw)
    assert len(losses) == 20
    assert losses[-1] < 0.2 * losses[0]
    model.eval()
    with torch.no_grad():
        for p, r in EXAMPLES:   # greedy next tokens reproduce the memorised responses
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
            assert logits.argmax(-1).tolist() == r
    assert supervised_fit(make_model(), EXAMPLES, **kw) == losses


def test_supervised_fit_leaves_global_rng_untouched(make_model):
    model = make_model()
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    supervised_fit(model, EXAMPLES, steps=3, lr=1e-3, batch_size=2, pad_id=PAD, seed=0, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_state))


def test_supervised_fit_trains_only_the_masked_in_tokens_of_a_triple(make_model):
    """(prompt, response, loss mask) triples, the warm start's conversations: a token with mask 0 (a tool's answer)
    is context, never a target; a pair trains every response token."""
    kw = dict(steps=1, lr=0.0, batch_size=1, pad_id=PAD, seed=0, device=torch.device("cpu"))
    (p, r), mask = EXAMPLES[2], [1, 0, 0, 1]
    model = make_model()
    masked = sft_batch([p], [r], PAD, loss_masks=[mask])
    with torch.no_grad():
        expected = sft_loss(model.eval(), masked).item()
        whole = sft_loss(model, sft_batch([p], [r], PAD)).item()
    assert supervised_fit(model, [(p, r, mask)], **kw) == [expected] != [whole]
    assert supervised_fit(model, [(p, r)], **kw) == [whole]
