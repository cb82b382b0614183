"""Loss aggregation: a (B, T) per-token loss matrix -> one scalar (verl's ``actor.loss_agg_mode``).

Modes, with ``m`` the 0/1 loss mask, ``L_i = sum_t l_{i,t} m_{i,t}`` and ``n_i = sum_t m_{i,t}``:

* ``token-mean``              ``sum_i L_i / N_tok``                    (DAPO, arXiv:2503.14476)
* ``token-sum``               ``sum_i L_i``
* ``seq-mean-token-sum``      ``sum_i L_i / N_seq``
* ``seq-mean-token-mean``     ``sum_i (L_i / n_i) / N_seq``             (original GRPO)
* ``seq-mean-token-sum-norm`` ``sum_i L_i / N_seq / C``                 (Dr.GRPO, arXiv:2503.20783)

Normalisation convention. ``N_tok`` / ``N_seq`` are the number of valid tokens / sequences (a sequence with
no valid token does not count) of the WHOLE mini-batch -- all micro-batches and all data-parallel ranks --
when the caller passes ``global_num_tokens`` / ``global_num_seqs`` (see ``global_batch_info``). Each
micro-batch loss is then that micro-batch's share of the mini-batch loss, so SUMMING the micro-batch losses
(gradient accumulation with no extra division) gives exactly the mini-batch loss, and gradients do not
depend on how the mini-batch was split. Without the global counts the micro-batch is normalised by its own
counts (correct when it is the whole mini-batch). A data-parallel wrapper that AVERAGES gradients over R
ranks must multiply each rank's loss by R (verl's ``dp_size`` factor); that is the trainer's job.

``C`` (``loss_scale_factor``) is a constant such as ``data.max_response_length``: it is never the padded
width of the micro-batch, which would change with the padding and break split-invariance.
"""

from __future__ import annotations

import torch

from lathe.algo.registry import unknown_name_error

__all__ = ["LOSS_AGG_MODES", "agg_loss", "global_batch_info"]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _denominator(count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def global_batch_info(loss_mask: torch.Tensor, loss_scale_factor: float | None = None) -> dict:
    """Counts of the whole mini-batch, as ``agg_loss`` keyword arguments.

    Compute them on the full mini-batch mask (and sum them over data-parallel ranks) before splitting into
    micro-batches; pass the dict as ``agg_kwargs`` to every micro-batch's loss.
    """
    valid = loss_mask.bool()
    return {
        "global_num_tokens": int(valid.sum()),
        "global_num_seqs": int(valid.any(dim=-1).sum()),
        "loss_scale_factor": loss_scale_factor,
    }


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens=None,
    global_num_seqs=None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) over ``loss_mask`` (B, T, 0/1) into a scalar; see the module docstring.

    Masked positions are selected away (``torch.where``), so neither their values nor NaN/inf there reach
    the loss or the gradient.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise unknown_name_error("loss aggregation mode", "actor.loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"agg_loss: loss_mat shape {tuple(loss_mat.shape)} != loss_mask {tuple(loss_mask.shape)}")
    valid = loss_mask.bool()
    masked = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-sum":
        return masked.sum()
    if loss_agg_mode == "token-mean":
        n_tok = valid.sum() if global_num_tokens is None else global_num_tokens
        return masked.sum() / _denominator(n_tok, masked)
    seq_sum = masked.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum = seq_sum / valid.sum(dim=-1).clamp(min=1).to(masked.dtype)
    n_seq = valid.any(dim=-1).sum() if global_num_seqs is None else global_num_seqs
    loss = seq_sum.sum() / _denominator(n_seq, masked)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError(
                f"loss_agg_mode=seq-mean-token-sum-norm needs a positive constant loss_scale_factor, got "
                f"{loss_scale_factor!r}; set actor.loss_scale_factor (e.g. to data.max_response_length)"
            )
        loss = loss / loss_scale_factor
    return loss
