"""Speculative decoding's exact parts: the target's processed distribution, the acceptance rule and its metrics.

A verify step scores a sequence's last token and its `k` draft tokens d_1..d_k (`mtp_draft.py`) in one forward: row
j of its logits is the target's distribution p_j of the token after d_j (row 0: after the last committed token). The
draft is deterministic (the MTP head's argmax: SGLang's EAGLE with `speculative_eagle_topk=1`, vLLM's `method=mtp`),
so speculative sampling with a one-point draft distribution (Leviathan et al. 2023, arXiv:2211.17192; Chen et al.
2023, arXiv:2302.01318) accepts d_j with probability p_{j-1}(d_j), and at the first rejection emits a token from p_{j-1}
with d_j's mass removed. lathe draws that by coupling: at each position j it draws x_j from p_j by inverse CDF with
the uniform `uniforms(seed, t_j)` of its output position t_j, exactly as the non-speculative sampler draws there, and

    for j = 1..k:  accept d_j when x_{j-1} = d_j  (probability p_{j-1}(d_j)), else emit x_{j-1} and stop
    all k accepted: emit x_k (the "bonus" token)

Given a rejection, x_{j-1} is distributed as p_{j-1} restricted to x != d_j and renormalised: the standard rule's
residual, so the outcomes (accepted drafts, emitted token) have the standard rule's distribution, and each emitted
token is distributed exactly as p at its position. The p here is what lathe's sampler draws from
(`sampler.sample_torch`): the stop ids banned before `min_tokens`, the logits divided by the temperature, top-k then
top-p, softmax; greedy rows (temperature 0) are one-hot at the argmax, so a draft is accepted exactly when it is the
greedy token and the emitted token is always the greedy one. Since every token is its position's own inverse-CDF draw,
whatever the drafts were, a sequence samples the tokens the non-speculative engine samples with the same seed (up to
the last bits of the logits, which the verify forward computes in another form), independently of its batch, of
preemption and of the draft layer: the drafts only decide how many tokens a step emits.

The log-prob returned with each token is the non-speculative sampler's: `log_softmax(logits / T)` of the verify
forward's row for that position, over the full vocabulary (T = 1 for greedy).
"""

from __future__ import annotations

import numpy as np
import torch

from lathe.device import to_device
from lathe.engine.sampler import ban, inverse_cdf, top_k_top_p, uniforms
from lathe.engine.sequence import Sequence, SequenceParams


def accept_drafts(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, u_sample: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted (B,), token (B,)): how many leading drafts each row accepts, and the token it emits after them.

    `probs` (B, K+1, V): the target's processed distributions p_0..p_K (row j: of the token after draft j); `drafts`
    (B, K) int64 (entries past `num_drafts[b]` ignored); `num_drafts` (B,) in 0..K; `u_sample` (B, K+1) uniforms in
    [0, 1), one per position: x_j is drawn from p_j by inverse CDF with u_sample[:, j] (as `sampler.sample_torch`
    draws), draft j+1 is accepted when x_j is it, and the token emitted at n = num_accepted is x_n (module doc)."""
    b, k = probs.shape[0], probs.shape[1] - 1
    drawn = inverse_cdf(probs, u_sample)                                # (B, K+1): x_0..x_K
    if k:
        live = torch.arange(k, device=probs.device)[None, :] < num_drafts[:, None]
        n = ((drawn[:, :k] == drafts) & live).long().cumprod(-1).sum(-1)
    else:
        n = torch.zeros(b, dtype=torch.long, device=probs.device)
    return n, drawn.gather(1, n[:, None])[:, 0]


def target_probs(logits: torch.Tensor, params: list[SequenceParams], banned: list[tuple[int, int]]) -> torch.Tensor:
    """(T, V) float32: each row's processed distribution as `sampler.sample_torch` samples it (module doc): row i has
    settings `params[i]`; `banned` the (row, token) pairs masked before min_tokens."""
    logits = logits.float()
    device = logits.device
    masked = ban(logits, banned)
    probs = torch.zeros_like(masked)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        g = to_device(torch.tensor(greedy), device)
        probs[g, masked[g].argmax(-1)] = 1.0
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        s = to_device(torch.tensor(sampled), device)
        x = masked[s] / to_device(torch.tensor([params[i].temperature for i in sampled]), device)[:, None]
        probs[s] = top_k_top_p(x, [params[i] for i in sampled]).softmax(-1)
    return probs


def verify_uniforms(seqs: list[Sequence], k: int) -> np.ndarray:
    """(B, K+1) sampling uniforms of a verify step whose rows start at each sequence's next output position: the
    non-speculative sampler's `uniforms(seed, t)` (module doc)."""
    seeds = np.repeat([s.seed or 0 for s in seqs], k + 1)
    first = np.array([s.num_output_tokens for s in seqs], dtype=np.int64)
    positions = (first[:, None] + np.arange(k + 1)[None, :]).reshape(-1)
    return uniforms(list(seeds), list(positions)).reshape(len(seqs), k + 1)


def spec_metrics(seqs: list[Sequence]) -> dict[str, float]:
    """The rollout's draft acceptance, per sample then averaged (verl's `compute_spec_decode_metrics`: each response
    weighs the same): `rollout/spec_accept_rate` (accepted / proposed drafts) and `rollout/spec_accept_length`
    (tokens a verify step emits: 1 + accepted / verify steps), plus the totals `rollout/spec_verify_steps`,
    `rollout/spec_draft_tokens` and `rollout/spec_accepted_tokens`."""
    if not seqs:
        return {}
    drafts = [s.spec_drafts for s in seqs]
    accepted = [s.spec_accepted for s in seqs]
    verifies = [s.spec_verifies for s in seqs]
    n = len(seqs)
    return {"rollout/spec_accept_rate": sum(a / d if d else 0.0 for a, d in zip(accepted, drafts)) / n,
            "rollout/spec_accept_length": sum(1 + a / v if v else 0.0 for a, v in zip(accepted, verifies)) / n,
            "rollout/spec_verify_steps": float(sum(verifies)),
            "rollout/spec_draft_tokens": float(sum(drafts)),
            "rollout/spec_accepted_tokens": float(sum(accepted)),
            SAMPLES: float(n)}


SAMPLES = "rollout/spec_samples"        # the responses the per-response means are over (for merging)
SPEC_TOTALS = ("rollout/spec_verify_steps", "rollout/spec_draft_tokens", "rollout/spec_accepted_tokens", SAMPLES)
SPEC_MEANS = ("rollout/spec_accept_rate", "rollout/spec_accept_length")


def merge_spec_metrics(into: dict[str, float], more: dict[str, float]) -> None:
    """Fold `more`'s speculative-decoding metrics into `into` (another rollout of the same step: a replica, a
    generation round, a request): totals summed, the per-response means weighted by their responses. Other keys are
    left to the caller."""
    if SAMPLES not in more:
        return
    old, new = into.get(SAMPLES, 0.0), more[SAMPLES]
    for key in SPEC_MEANS:
        into[key] = (into.get(key, 0.0) * old + more[key] * new) / max(old + new, 1.0)
    for key in SPEC_TOTALS:
        into[key] = into.get(key, 0.0) + more[key]
