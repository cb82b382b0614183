"""Converting a padded (B, L) batch to one packed token stream and back (verl's `use_remove_padding`).

Packing keeps the real tokens of each row, in order, end to end; `cu_seqlens` marks where each row
starts. Removing masked keys is exactly what masking them does, so attention over the packed stream
(causal within each row) equals masked attention over the padded batch at every real position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """A padded batch flattened to its T real tokens."""

    input_ids: torch.Tensor      # (T,)
    position_ids: torch.Tensor   # (T,)
    cu_seqlens: torch.Tensor     # (B+1,) int32: row b holds tokens cu_seqlens[b]:cu_seqlens[b+1]
    max_seqlen: int              # longest row, in real tokens
    indices: torch.Tensor        # (T,) positions of the real tokens in the flattened (B*L) batch
    batch_shape: tuple[int, int]  # (B, L)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> PackedBatch:
    """Pack the real tokens (`attention_mask == 1`) of a (B, L) batch; positions default to the mask's count."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must have the same (batch, length) shape")
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    mask = attention_mask.bool()
    seqlens = mask.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    indices = mask.flatten().nonzero(as_tuple=True)[0]
    return PackedBatch(
        input_ids=input_ids.flatten()[indices],
        position_ids=position_ids.flatten()[indices],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max().item()) if seqlens.numel() else 0,
        indices=indices,
        batch_shape=(input_ids.shape[0], input_ids.shape[1]),
    )


def pack_sequences(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(input_ids (T,), position_ids (T,), cu_seqlens (S+1,), max_seqlen) for a list of 1-D token tensors."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    input_ids = torch.cat(list(sequences))
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences]).to(input_ids.device)
    return input_ids, position_ids, cu_seqlens.to(input_ids.device), int(lengths.max().item())


def unpack_to_padded(x: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token values x (T, ...) back to (B, L, ...); padding gets `fill`. Differentiable."""
    B, L = packed.batch_shape
    out = x.new_full((B * L, *x.shape[1:]), fill)
    out = out.index_copy(0, packed.indices, x)
    return out.view(B, L, *x.shape[1:])
