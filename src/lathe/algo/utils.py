"""Masked statistics and prompt-group helpers shared by every algorithm module.

All tensors are response-aligned ``(batch, seq)`` with a 0/1 ``mask`` (bool or float). Masked positions are
*selected away* with ``torch.where`` rather than multiplied by zero, so a NaN/inf left in padding (e.g. a
log-prob of a pad token) can never leak into a statistic or its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "group_ids",
    "entropy_from_logits",
]


def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is set (all positions, or along ``dim``)."""
    picked = torch.where(_bool(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked positions: ``sum(v * m) / sum(m)``; 0 where no position is valid (never NaN)."""
    count = _bool(mask).sum() if dim is None else _bool(mask).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked positions.

    ``unbiased`` applies Bessel's correction ``n / (n - 1)`` as verl does. With fewer than two valid
    positions the variance is 0 (verl raises instead; a zero spread is the harmless answer for whitening).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = _bool(mask).sum().to(values.dtype)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise over masked positions: ``(v - mean) / sqrt(var_unbiased + 1e-8)`` (verl's whitening).

    With ``shift_mean=False`` the mean is added back (only the spread is normalised). Padding positions
    are returned as computed (callers multiply by the mask where they need zeros there).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def group_ids(index: Sequence | np.ndarray, batch_size: int, device: torch.device | None = None):
    """Map per-row prompt ids (``uid`` strings/ints) to dense group numbers.

    Returns ``(gid, counts)``: ``gid`` (B,) long tensor with values in ``[0, G)`` and ``counts`` (G,) the
    number of rows per group. Rows sharing an id are one prompt's ``rollout.n`` samples.
    """
    if index is None:
        raise ValueError("index is None: group-based estimators need one prompt id (uid) per row")
    arr = np.asarray(index, dtype=object) if not isinstance(index, np.ndarray) else index
    if arr.ndim != 1 or len(arr) != batch_size:
        raise ValueError(
            f"index has shape {tuple(arr.shape)} but the batch has {batch_size} rows; pass one group id per row"
        )
    keys = [k.item() if hasattr(k, "item") else k for k in arr.tolist()]
    mapping: dict = {}
    gid = [mapping.setdefault(k, len(mapping)) for k in keys]
    gid_t = torch.tensor(gid, dtype=torch.long, device=device)
    counts = torch.bincount(gid_t, minlength=len(mapping))
    return gid_t, counts


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy ``H = logsumexp(z) - sum(softmax(z) * z)`` over the last dim: (B,T,V) -> (B,T)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
