"""Log-probabilities and entropy of target tokens, computed from hidden states chunk by chunk.

The naive way, `log_softmax(hidden @ W.T / T)`, holds a (tokens x vocab) float32 tensor (and its
gradient) for the whole micro-batch: 4 GiB for 8k tokens of a 152k vocabulary. Here tokens go through
`lm_head` `chunk_size` at a time; the forward keeps only per-token results, and the backward recomputes
each chunk's logits to form its gradient. Peak extra memory is O(chunk_size x vocab), independent of
the number of tokens. Value and gradient equal the naive computation.

Temperature is applied as `logits / temperature`, the way the rollout sampled, with logits computed in
the weight dtype and then cast to float32 (as `model(...).logits.float()` does).

    log p(y_t)  = z_t[y_t] - logsumexp(z_t),          z_t = (h_t W^T) / T
    entropy_t   = logsumexp(z_t) - sum_v p_tv z_tv
    d logp / dz = onehot(y_t) - p_t
    d H / dz    = -p_t * (z_t - E_p[z_t])
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 (so gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                 with_entropy: bool):
    """(logp, entropy or None, logits, lse) of one chunk; logits are float32 and temperature-scaled."""
    logits = (h @ weight.t()).to(_acc_dtype(h.dtype)) / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy, logits, lse


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function behind `chunked_log_probs`; saves only inputs and per-token scalars."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logp = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc) if with_entropy else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            lp, ent, _, _ = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature, with_entropy)
            logp[s:e] = lp
            if with_entropy:
                entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        if with_entropy:
            return logp, entropy
        empty = hidden.new_zeros(0, dtype=acc)
        ctx.mark_non_differentiable(empty)
        return logp, empty

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        T, n = ctx.temperature, hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_w else None
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e]
            _, _, logits, lse = _chunk_stats(h, weight, targets[s:e], T, False)
            probs = torch.exp(logits - lse.unsqueeze(-1))
            grad_z = probs * (-grad_logp[s:e].unsqueeze(-1))
            grad_z.scatter_add_(-1, targets[s:e].unsqueeze(-1), grad_logp[s:e].unsqueeze(-1).to(grad_z.dtype))
            if use_entropy:
                mean_z = (probs * logits).sum(-1, keepdim=True)
                grad_z -= grad_entropy[s:e].unsqueeze(-1) * probs * (logits - mean_z)
            grad_raw = (grad_z / T).to(weight.dtype)
            if need_h:
                grad_h[s:e] = grad_raw @ weight
            if need_w:
                grad_w += (grad_raw.t() @ h).to(grad_w.dtype)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                      temperature: float = 1.0, chunk_size: int = 1024, calculate_entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy or None) of `targets` under `softmax(hidden @ weight.T / temperature)`.

    hidden: (..., H) hidden states (any leading shape); weight: (V, H) the `lm_head` weight;
    targets: (...) token ids in [0, V). Returns float32 tensors shaped like `targets`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (it divides the logits)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: hidden must "
                         "be targets' shape plus a hidden dimension")
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    logp, entropy = _ChunkedLogProbs.apply(h, weight, t, float(temperature), int(chunk_size),
                                           bool(calculate_entropy))
    return logp.view(lead), (entropy.view(lead) if calculate_entropy else None)


def naive_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    temperature: float = 1.0, calculate_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full-logits reference: same results as `chunked_log_probs`, (tokens x vocab) memory."""
    logits = (hidden @ weight.t()).to(_acc_dtype(hidden.dtype)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if calculate_entropy else None
    return logp, entropy


def response_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       responses: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024,
                       calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) log-probs (and entropy) of `responses`, the last R tokens of `input_ids`, under a lathe model.

    The same contract as `lathe.train.logprob.response_log_probs`, without full logits: the logits that
    predict the response are those at the R positions before it.
    """
    R = responses.shape[1]
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   return_hidden=True).hidden_states[:, -R - 1:-1]
    return chunked_log_probs(hidden, model.lm_head.weight, responses, temperature=temperature,
                             chunk_size=chunk_size, calculate_entropy=calculate_entropy)
