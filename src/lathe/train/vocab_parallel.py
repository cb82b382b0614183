"""Log-probs, entropy and sum of p^2 over an lm_head cut over the vocabulary (tensor parallelism,
`lathe.train.tensor_parallel`), chunk by chunk as `lathe.models.logprob.chunked_token_stats` computes them, without
ever forming a token's full logits on one rank.

Each rank of the tensor-parallel group holds rows [lo, hi) of the lm_head weight, so the logits z = h W^T / T of a
chunk of tokens are split over the ranks by vocabulary. For each token:

    m        = max_ranks (max_v z_v)                                  (an all-reduce MAX)
    S        = sum_ranks sum_v exp(z_v - m),   E = sum_ranks sum_v exp(z_v - m) z_v,
    z_y      = sum_ranks (z_y on the rank that holds y, else 0),  Q = sum_ranks sum_v exp(z_v - m)^2
                                                                      (one all-reduce SUM of the four)
    lse = m + log S,   log p(y) = z_y - lse,   entropy = lse - E / S,   sum_v p_v^2 = Q / S^2

The backward recomputes each chunk's local logits: d/dz = (onehot(y) - p) g_logp - p (z - E/S) g_entropy on the
rank's own columns (the one-hot only on the rank that holds y), the weight slice's gradient is local, and the hidden
states' gradient is the sum over the ranks' slices (an all-reduce SUM): every rank holds the same hidden states and
the same loss, so each needs the whole gradient. This is Megatron's vocab-parallel cross-entropy extended to the
entropy and the temperature; DTensor's `loss_parallel` covers only the cross-entropy of a DTensor of logits, which
would mean a (tokens x vocab/T) logits tensor for the whole micro-batch and its softmax saved for backward, instead
of one chunk at a time.

The top-k forward KL of distillation reads the student's log-probs of k given tokens per position (the teacher's top
k) and the student's own top k (`vocab_parallel_topk_log_probs`): the same max and sums, each rank picking the given
ids it holds, differentiable through two group operations (Megatron's "f" and "g": a sum over the group whose
backward keeps this rank's gradient, and an identity whose backward sums the ranks' gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lathe.models.logprob import _acc_dtype, _chunk_bounds, chunked_token_stats


def vocab_sharded(weight) -> bool:
    """An lm_head weight cut over the vocabulary by tensor parallelism (a DTensor sharded on dim 0)."""
    from torch.distributed.tensor import DTensor, Shard
    return isinstance(weight, DTensor) and any(p == Shard(0) for p in weight.placements)


def token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                chunk_size: int = 1024, calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False,
                compile_backend: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`chunked_token_stats`, over a vocabulary-parallel lm_head weight when `weight` is one (`vocab_sharded`)."""
    if not vocab_sharded(weight):
        return chunked_token_stats(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                                   calculate_entropy=calculate_entropy,
                                   calculate_sum_pi_squared=calculate_sum_pi_squared, compile_backend=compile_backend)
    return vocab_parallel_token_stats(hidden, weight.to_local(), targets, weight.device_mesh.get_group(),
                                      vocab_size=weight.shape[0], temperature=temperature, chunk_size=chunk_size,
                                      calculate_entropy=calculate_entropy,
                                      calculate_sum_pi_squared=calculate_sum_pi_squared)


def vocab_parallel_token_stats(hidden: torch.Tensor, local_weight: torch.Tensor, targets: torch.Tensor, group, *,
                               vocab_size: int, temperature: float = 1.0, chunk_size: int = 1024,
                               calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-probs, entropy or None, sum p^2 or None) of `targets` (token ids in [0, vocab_size)) under
    softmax(hidden @ W^T / temperature), where this rank of `group` holds `local_weight`, rows [lo, lo + rows) of W
    (torch's even chunking over the group: rank r's rows start at r x ceil(V / size)). Shaped like `targets`,
    float32 (float64 for float64 inputs); differentiable in `hidden` and `local_weight`."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (it divides the logits)")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: hidden must "
                         "be targets' shape plus a hidden dimension")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    lo = min(me * -(-vocab_size // size), vocab_size)
    lead = targets.shape
    logp, entropy, sum_sq = _VocabParallelStats.apply(
        hidden.reshape(-1, hidden.shape[-1]), local_weight, targets.reshape(-1).long(), group, lo, float(temperature),
        int(chunk_size), bool(calculate_entropy), bool(calculate_sum_pi_squared))
    return (logp.view(lead), entropy.view(lead) if calculate_entropy else None,
            sum_sq.view(lead) if calculate_sum_pi_squared else None)


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    return (h @ w.t()).to(_acc_dtype(h.dtype)) / temperature


def _local_target(z: torch.Tensor, targets: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether this rank holds each target, its column here (0 when not))."""
    mine = (targets >= lo) & (targets < lo + z.shape[-1])
    return mine, torch.where(mine, targets - lo, 0)


class _VocabParallelStats(torch.autograd.Function):
    """Behind `vocab_parallel_token_stats`: saves the inputs and per-token scalars only (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, lo, temperature, chunk_size, with_entropy, with_sum_sq):
        n, acc = hidden.shape[0], _acc_dtype(hidden.dtype)
        logp, lse, mean_z, sum_sq = (hidden.new_zeros(n, dtype=acc) for _ in range(4))
        for s, e in _chunk_bounds(n, chunk_size):
            z = _logits(hidden[s:e], weight, temperature)
            top = z.amax(-1) if z.shape[-1] else z.new_full((e - s,), -torch.inf)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            ex = torch.exp(z - top.unsqueeze(-1))
            mine, col = _local_target(z, targets[s:e], lo)
            z_y = torch.where(mine, z.gather(-1, col.unsqueeze(-1)).squeeze(-1) if z.shape[-1] else 0.0, 0.0)
            sums = torch.stack([ex.sum(-1), (ex * z).sum(-1), z_y, (ex * ex).sum(-1) if with_sum_sq else z_y * 0])
            dist.all_reduce(sums, group=group)
            total, lse[s:e] = sums[0], top + torch.log(sums[0])
            mean_z[s:e], logp[s:e] = sums[1] / total, sums[2] - lse[s:e]
            if with_sum_sq:
                sum_sq[s:e] = sums[3] / (total * total)
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.set_materialize_grads(False)
        ctx.group, ctx.lo, ctx.temperature, ctx.chunk_size = group, lo, temperature, chunk_size
        ctx.mark_non_differentiable(sum_sq)
        entropy = lse - mean_z if with_entropy else hidden.new_zeros(0, dtype=acc)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy, sum_sq

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device)
        use_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for s, e in _chunk_bounds(hidden.shape[0], ctx.chunk_size):
            h = hidden[s:e]
            z = _logits(h, weight, ctx.temperature)
            probs = torch.exp(z - lse[s:e].unsqueeze(-1))
            g = grad_logp[s:e].unsqueeze(-1)
            grad_z = probs * -g
            mine, col = _local_target(z, targets[s:e], ctx.lo)
            grad_z.scatter_add_(-1, col.unsqueeze(-1), torch.where(mine.unsqueeze(-1), g, 0.0).to(grad_z.dtype))
            if use_entropy:
                grad_z = grad_z - grad_entropy[s:e].unsqueeze(-1) * probs * (z - mean_z[s:e].unsqueeze(-1))
            grad_raw = (grad_z / ctx.temperature).to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = grad_raw @ weight
            grad_w += (grad_raw.t() @ h).to(grad_w.dtype)
        if grad_h is not None:
            dist.all_reduce(grad_h, group=ctx.group)     # the whole vocabulary's part: every rank's columns
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def vocab_parallel_topk_log_probs(hidden: torch.Tensor, local_weight: torch.Tensor, ids: torch.Tensor, group, *,
                                  vocab_size: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (n, k) of the token ids `ids` (n, k) under softmax(hidden (n, H) @ W^T / temperature),
    differentiable in `hidden` and `local_weight`; the group's k most likely token ids (n, k), no gradient), where
    this rank of `group` holds `local_weight` (rows as in `vocab_parallel_token_stats`). One chunk of tokens: this
    rank forms its (n, V / size) logits; the caller recomputes them in backward (`torch.utils.checkpoint`)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    lo, k = min(me * -(-vocab_size // size), vocab_size), ids.shape[-1]
    z = _logits(_SumGradients.apply(hidden, group), local_weight, temperature)
    top = z.detach().amax(-1) if z.shape[-1] else z.new_full(z.shape[:1], -torch.inf)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    mine, col = _local_target(z, ids, lo)
    picked = torch.where(mine, z.gather(-1, col) if z.shape[-1] else 0.0, 0.0)
    sums = _GroupSum.apply(torch.cat([torch.exp(z - top.unsqueeze(-1)).sum(-1, keepdim=True), picked], -1), group)
    logp = sums[:, 1:] - (top + torch.log(sums[:, 0])).unsqueeze(-1)
    # the group's top k: each rank's own top k (padded to k with -inf when it holds fewer columns), then the best k
    values = z.detach().new_full((z.shape[0], k), -torch.inf)
    where = torch.zeros(z.shape[0], k, dtype=torch.long, device=z.device)
    local = z.detach().topk(min(k, z.shape[-1]), dim=-1)
    values[:, :local.values.shape[-1]], where[:, :local.values.shape[-1]] = local.values, local.indices + lo
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_ids = [torch.empty_like(where) for _ in range(size)]
    dist.all_gather(all_values, values, group=group)
    dist.all_gather(all_ids, where, group=group)
    best = torch.cat(all_values, -1).topk(k, dim=-1).indices
    return logp, torch.cat(all_ids, -1).gather(-1, best)


class _GroupSum(torch.autograd.Function):
    """The group's sum of a tensor every rank computed from its own slice; the backward keeps this rank's gradient
    (every rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradients(torch.autograd.Function):
    """The identity on an input every rank of the group holds whole; the backward sums the ranks' gradients (each
    rank's covers its own slice of the vocabulary)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
