"""Sampling the next token: temperature, top-k, top-p, per-sequence generators; greedy at temperature 0.

The returned log-prob is `log_softmax(logits / T)` of the chosen token over the full vocabulary, T=1 for
greedy: the quantity the trainer recomputes (and `HFRollout` returns), not the truncated distribution
that top-k/top-p sampled from. `min_tokens` bans the stop ids from being sampled, never from the log-prob.

Each sequence draws from its own `torch.Generator` with a fixed number of draws per step, so what it
samples does not depend on the other sequences in the batch.
"""

from __future__ import annotations

import torch

from lathe.engine.sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the smallest set holding `top_p` of the mass.

    Order as transformers' warpers and vLLM: top-k first, then top-p over what is left. `logits` (V,).
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) >= top_p        # tokens after the mass already reached top_p
        remove[0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) for logits (B, V) float32, one row per sequence."""
    tokens, logprobs = [], []
    for row, seq in zip(logits, seqs):
        p = seq.params
        banned = p.stop_token_ids if seq.num_output_tokens < p.min_tokens else ()
        if banned:
            row_s = row.clone()
            row_s[list(banned)] = float("-inf")
        else:
            row_s = row
        if p.greedy:
            tok = int(row_s.argmax())
        else:
            warped = apply_top_k_top_p(row_s / p.temperature, p.top_k, p.top_p)
            probs = warped.softmax(-1)
            tok = int(torch.multinomial(probs, 1, generator=seq.generator))
        logprobs.append(float(torch.log_softmax(row / p.logprob_temperature, -1)[tok]))
        tokens.append(tok)
    return tokens, logprobs
