"""lathe.train.topk: the teacher's top-k and the student's log-probs of them, against a transformers model's full
(B, R, V) log-softmax (an independent path), packed and padded, values and gradients."""

import pytest
import torch

from lathe.train.topk import batched_teacher_topk, student_topk_log_probs, teacher_topk

K = 5


def _full(hf, batch, temperature=1.0) -> torch.Tensor:
    R = batch["responses"].shape[1]
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"]).logits[:, -R - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_teachers_top_k_is_the_full_log_softmax_top_k(make_model, make_lathe, rollout_batch, remove_padding):
    batch = rollout_batch(rows=6, seed=4)
    valid = batch["response_mask"].bool()
    with torch.no_grad():
        want = _full(make_model(3), batch).topk(K, dim=-1)
        values, ids = batched_teacher_topk(make_lathe(3), batch, k=K, micro_batch_size=4, remove_padding=remove_padding)
        hf_values, hf_ids = teacher_topk(make_model(3), batch, k=K)
    for got_v, got_i in ((values, ids), (hf_values, hf_ids)):
        torch.testing.assert_close(got_v[valid], want.values[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(got_i[valid], want.indices[valid])
        assert float(got_v[~valid].abs().max()) == 0.0 and int(got_i[~valid].abs().max()) == 0


def test_the_teachers_top_k_keeps_to_the_students_ids(make_model, make_lathe, rollout_batch):
    """A teacher with more output rows than the student's vocabulary: the k come from the student's ids, with the
    teacher's own log-probs of them (its full softmax), on both paths."""
    batch = rollout_batch(rows=4, seed=5)
    valid = batch["response_mask"].bool()
    with torch.no_grad():
        full = _full(make_model(3), batch)
        vocab = full.shape[-1] - 7
        assert not bool((full.topk(K, dim=-1).indices[valid] < vocab).all()), "precondition: a top id past vocab"
        want = full[..., :vocab].topk(K, dim=-1)
        got = [batched_teacher_topk(make_lathe(3), batch, k=K, micro_batch_size=4, vocab=vocab),
               teacher_topk(make_model(3), batch, k=K, vocab=vocab)]
    for values, ids in got:
        torch.testing.assert_close(values[valid], want.values[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(ids[valid], want.indices[valid]) and int(ids.max()) < vocab


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_students_log_probs_of_given_tokens_and_their_gradient(make_model, make_lathe, rollout_batch,
                                                                   remove_padding):
    batch = rollout_batch(rows=6, seed=5)
    valid = batch["response_mask"].bool()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (*valid.shape, K), generator=g) * valid.unsqueeze(-1)
    weights = torch.randn(*valid.shape, K, generator=g) * valid.unsqueeze(-1)
    hf, lathe = make_model(0), make_lathe(0)
    want = _full(hf, batch, temperature=0.7).gather(-1, ids)
    (want * weights).sum().backward()
    got, own = student_topk_log_probs(lathe, batch, ids, temperature=0.7, remove_padding=remove_padding, chunk_size=4)
    (got * weights).sum().backward()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(own[valid], _full(hf, batch, 0.7).topk(K, dim=-1).indices[valid])
    grads = dict(hf.named_parameters())
    compared = [name for name, p in lathe.named_parameters() if name in grads and p.grad is not None]
    assert len(compared) > 10, compared
    for name in compared:
        torch.testing.assert_close(dict(lathe.named_parameters())[name].grad, grads[name].grad, rtol=1e-4, atol=1e-5)
