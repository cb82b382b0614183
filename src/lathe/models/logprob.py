"""Log-probabilities and entropy of target tokens, computed from hidden states chunk by chunk.

The naive way, `log_softmax(hidden @ W.T / T)`, holds a (tokens x vocab) float32 tensor (and its
gradient) for the whole micro-batch: 4 GiB for 8k tokens of a 152k vocabulary. Here tokens go through
`lm_head` `chunk_size` at a time; the forward keeps only per-token results (log-prob, logsumexp, E_p[z]), and
the backward recomputes each chunk's logits to form its gradient in one elementwise pass from them. Peak extra
memory is O(chunk_size x vocab), independent of the number of tokens. Value and gradient equal the naive
computation.

Temperature is applied as `logits / temperature`, the way the rollout sampled, with logits computed in
the weight dtype and then cast to float32 (as `model(...).logits.float()` does).

    log p(y_t)  = z_t[y_t] - logsumexp(z_t),          z_t = (h_t W^T) / T
    entropy_t   = logsumexp(z_t) - sum_v p_tv z_tv
    sum_pi_sq_t = sum_v p_tv^2 = sum_v exp(z_tv - m)^2 / (sum_v exp(z_tv - m))^2     (no gradient; the optimal
                                                                                       token baseline's input)
    d logp / dz = onehot(y_t) - p_t
    d H / dz    = -p_t * (z_t - E_p[z_t])
"""

from __future__ import annotations

import functools

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 (so gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return (h @ weight.t()).to(_acc_dtype(h.dtype)) / temperature


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_sum_sq: bool = False) -> tuple[torch.Tensor, ...]:
    """(logp, lse, mean_z) of one chunk of rows: lse = logsumexp(z), mean_z = E_p[z] (entropy = lse - mean_z).
    One pass for the row max, one for both sums: the two reductions a compiled chunk needs, instead of separate
    logsumexp and softmax passes over the (rows x vocab) logits. `with_sum_sq`: also sum_v p_v^2 of each row, from
    the same shifted exponentials (one more reduction)."""
    logits = _chunk_logits(h, weight, temperature)
    top = logits.amax(-1, keepdim=True)
    e = torch.exp(logits - top)
    total = e.sum(-1)
    lse = top.squeeze(-1) + torch.log(total)
    mean_z = (e * logits).sum(-1) / total
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if with_sum_sq:
        return logp, lse, mean_z, (e * e).sum(-1) / (total * total)
    return logp, lse, mean_z


def _chunk_grad(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                mean_z: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
    """Gradient with respect to the raw logits `h @ W^T` of one chunk (recomputed), in the weight dtype. The
    forward's per-row lse and E_p[z] make it one elementwise pass (no reduction over the vocabulary)."""
    logits = _chunk_logits(h, weight, temperature)
    probs = torch.exp(logits - lse.unsqueeze(-1))
    g = grad_logp.unsqueeze(-1)
    if torch.compiler.is_compiling():
        # compiled: the target's one-hot as a comparison, so the chunk's gradient is one elementwise pass, logits in,
        # gradient out (a scatter_add_ splits it in two around a float32 copy of the whole chunk)
        target = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
        grad_z = torch.where(target, g, 0.0) - probs * g
    else:           # eager: in place, fewer (chunk x vocabulary) temporaries
        grad_z = probs * -g
        grad_z.scatter_add_(-1, targets.unsqueeze(-1), g.to(grad_z.dtype))
    if grad_entropy is not None:
        grad_z = grad_z - grad_entropy.unsqueeze(-1) * probs * (logits - mean_z.unsqueeze(-1))
    return (grad_z / temperature).to(weight.dtype)


@functools.cache
def _accumulates_in_place(device_type: str) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=float32, out=acc)` adds a half-precision product into a float32
    accumulator in one GEMM here (CUDA builds that have `addmm.dtype_out`); checked once on a small product."""
    if device_type != "cuda":
        return False
    try:
        a = torch.randn(64, 32, device=device_type, dtype=torch.bfloat16)
        b = torch.randn(32, 48, device=device_type, dtype=torch.bfloat16)
        acc = torch.ones(64, 48, device=device_type)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        want = 1.0 + a.float() @ b.float()
        return bool(((acc - want).norm() / want.norm()) < 1e-2)
    except (RuntimeError, TypeError):
        return False


def _add_weight_grad(grad_w: torch.Tensor, grad_raw: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w += grad_raw^T @ h, grad_w float32. Half-precision inputs on CUDA: one GEMM that accumulates into
    grad_w in its epilogue (a separate product, cast and add is a visible share of a small model's training step);
    else a product cast and added (in float32 throughout for float32 inputs)."""
    if grad_raw.dtype == grad_w.dtype:
        grad_w.addmm_(grad_raw.t(), h)
    elif _accumulates_in_place(grad_w.device.type):
        torch.addmm(grad_w, grad_raw.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w += (grad_raw.t() @ h).to(grad_w.dtype)


@functools.cache
def _chunk_ops(compile_backend: str | None):
    """(forward, grad) chunk functions: eager, or compiled once per process with `compile_backend`."""
    if compile_backend is None:
        return _chunk_forward, _chunk_grad
    return (torch.compile(_chunk_forward, backend=compile_backend),
            torch.compile(_chunk_grad, backend=compile_backend))



def _rows_dynamic(compiled: bool, *tensors: torch.Tensor | None) -> None:
    """Mark dim 0 (the chunk's rows: the last chunk is shorter) dynamic, so a compiled chunk function compiles
    once for all row counts; vocabulary and hidden sizes stay static."""
    if compiled:
        for t in tensors:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)


def _chunk_bounds(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of `n` rows. A 1-row remainder joins the chunk before it: torch.compile
    specialises size-1 dimensions, so a compiled chunk function would compile again for it."""
    starts = list(range(0, n, chunk_size))
    if chunk_size > 1 and len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [(s, e) for s, e in zip(starts, [*starts[1:], n])]


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function behind `chunked_log_probs`; saves only inputs and per-token scalars."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, compile_backend,
                with_sum_sq=False):
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        chunk_forward, _ = _chunk_ops(compile_backend)
        logp, lse, mean_z = (hidden.new_empty(n, dtype=acc) for _ in range(3))
        sum_sq = hidden.new_empty(n if with_sum_sq else 0, dtype=acc)
        for s, e in _chunk_bounds(n, chunk_size):
            h, t = hidden[s:e], targets[s:e]
            _rows_dynamic(compile_backend is not None, h, t)
            if with_sum_sq:
                logp[s:e], lse[s:e], mean_z[s:e], sum_sq[s:e] = chunk_forward(h, weight, t, temperature, True)
            else:
                logp[s:e], lse[s:e], mean_z[s:e] = chunk_forward(h, weight, t, temperature)
        ctx.mark_non_differentiable(sum_sq)
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        # an output the loss does not use (the entropy, detached when its coefficient is 0) gets None, not a zero
        # tensor: its gradient term is then skipped instead of computed as zeros (a pass over every chunk's logits)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.compile_backend = compile_backend
        if with_entropy:
            return logp, lse - mean_z, sum_sq
        empty = hidden.new_zeros(0, dtype=acc)
        ctx.mark_non_differentiable(empty)
        return logp, empty, sum_sq

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        _, chunk_grad = _chunk_ops(ctx.compile_backend)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_w else None
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logp is None:                   # only the entropy is in the loss
            grad_logp = torch.zeros_like(lse)
        for s, e in _chunk_bounds(n, ctx.chunk_size):
            h, t, g_lp = hidden[s:e], targets[s:e], grad_logp[s:e]
            g_ent = grad_entropy[s:e] if use_entropy else None
            lse_c, mean_c = lse[s:e], mean_z[s:e]
            _rows_dynamic(ctx.compile_backend is not None, h, t, lse_c, mean_c, g_lp, g_ent)
            grad_raw = chunk_grad(h, weight, t, lse_c, mean_c, g_lp, g_ent, ctx.temperature)
            if need_h:
                grad_h[s:e] = grad_raw @ weight
            if need_w:
                _add_weight_grad(grad_w, grad_raw, h)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                      temperature: float = 1.0, chunk_size: int = 1024, calculate_entropy: bool = False,
                      compile_backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy or None) of `targets` under `softmax(hidden @ weight.T / temperature)`.

    hidden: (..., H) hidden states (any leading shape); weight: (V, H) the `lm_head` weight;
    targets: (...) token ids in [0, V). Returns float32 tensors shaped like `targets`.
    `compile_backend`: run the per-chunk math under `torch.compile(backend=...)` (a compiled model's
    `model.compile_backend`); None = eager. Same values either way, up to float rounding.
    """
    logp, entropy, _ = chunked_token_stats(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                                           calculate_entropy=calculate_entropy, compile_backend=compile_backend)
    return logp, entropy


def chunked_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                        temperature: float = 1.0, chunk_size: int = 1024, calculate_entropy: bool = False,
                        calculate_sum_pi_squared: bool = False, compile_backend: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`chunked_log_probs` plus, with `calculate_sum_pi_squared`, each token's sum_v p_v^2 (shaped like `targets`,
    no gradient), computed in the same pass over each chunk's logits; else None in its place."""
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
    logp, entropy, sum_sq = _ChunkedLogProbs.apply(h, weight, t, float(temperature), int(chunk_size),
                                                   bool(calculate_entropy), compile_backend,
                                                   bool(calculate_sum_pi_squared))
    return (logp.view(lead), (entropy.view(lead) if calculate_entropy else None),
            (sum_sq.view(lead) if calculate_sum_pi_squared else None))


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
    predict the response are those at the R positions before it. A compiled model (`compile_decoder`) also
    compiles the chunk math.
    """
    logp, entropy, _ = response_token_stats(model, input_ids, attention_mask, position_ids, responses,
                                            temperature=temperature, chunk_size=chunk_size,
                                            calculate_entropy=calculate_entropy)
    return logp, entropy


def response_token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         responses: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024,
                         calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`response_log_probs` plus, with `calculate_sum_pi_squared`, each position's sum_v p_v^2 (B, R), else None."""
    R = responses.shape[1]
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   return_hidden=True).hidden_states[:, -R - 1:-1]
    return chunked_token_stats(hidden, model.lm_head.weight, responses, temperature=temperature,
                               chunk_size=chunk_size, calculate_entropy=calculate_entropy,
                               calculate_sum_pi_squared=calculate_sum_pi_squared,
                               compile_backend=getattr(model, "compile_backend", None))
