"""`sum_pi_squared` of the response tokens on every log-prob path, against a per-row float64 forward."""

import pytest
import torch

from lathe.models.hf import lathe_from_transformers
from lathe.train.logprob import batched_token_stats, response_token_stats

from helpers import assert_close_rel


@pytest.mark.parametrize("impl", ["hf", "lathe-padded", "lathe-packed"])
def test_sum_pi_squared_matches_manual_forward(make_model, rollout_batch, impl):
    model, batch = make_model().eval(), rollout_batch()
    run = lathe_from_transformers(model).eval() if impl.startswith("lathe") else model
    with torch.no_grad():
        logp, _, sum_sq = response_token_stats(run, batch, temperature=0.7, calculate_sum_pi_squared=True,
                                               remove_padding=impl == "lathe-packed", chunk_size=5)
        batched = batched_token_stats(run, batch, micro_batch_size=2, temperature=0.7, calculate_sum_pi_squared=True,
                                      remove_padding=impl == "lathe-packed")
    assert sum_sq.shape == logp.shape and batched[1] is None
    assert_close_rel(batched[2], sum_sq, name="micro-batched sum p^2")
    for row in range(len(batch)):
        prompt = batch["prompts"][row][batch["attention_mask"][row, :batch["prompts"].shape[1]].bool()]
        n = int(batch["response_mask"][row].sum())
        ids = torch.cat([prompt, batch["responses"][row, :n]])[None]
        with torch.no_grad():
            probs = torch.softmax(model(ids).logits[0, len(prompt) - 1:-1].double() / 0.7, -1)
        assert_close_rel(sum_sq[row, :n], (probs ** 2).sum(-1), name=f"sum p^2 of row {row}")
