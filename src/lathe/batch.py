"""The one batch type that flows between the steps of an RL iteration.

A `Batch` holds per-sample tensors (all sharing the leading dimension), per-sample Python objects
(numpy object arrays: raw prompts, ground truths, data sources ...) and batch-level `meta`.
Every step takes a batch and returns one, so a step can run in this process or on a Ray worker
group without the driver noticing (the single-controller style of HybridFlow).

Layout of the tensors the RL steps exchange (verl's names):
    prompts         (B, P)    left-padded prompt ids
    responses       (B, R)    right-padded response ids
    input_ids       (B, P+R)  prompts then responses
    attention_mask  (B, P+R)  1 on real tokens
    position_ids    (B, P+R)
    response_mask   (B, R)    1 on response tokens the loss sees
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _as_object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


# (B,) bool: a ghost row pads a data-parallel rank's share and counts for nothing (`lathe.cluster.dispatch`)
GHOST = "ghost_row"


def real_rows(batch: "Batch") -> int:
    """The rows of `batch` that are not ghost rows (`GHOST`)."""
    return len(batch) - (int(batch[GHOST].sum()) if GHOST in batch else 0)


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: v if isinstance(v, np.ndarray) else _as_object_array(v)
                            for k, v in self.non_tensors.items()}
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> Any:
        """`batch["responses"]`: a tensor or an object array, by name."""
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"batch has no field {key!r}; it has {sorted(self.tensors) + sorted(self.non_tensors)}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a field; a value of the wrong size raises and leaves the batch unchanged."""
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            value = _as_object_array(value)
        sizes = {k: v.shape[0] if isinstance(v, torch.Tensor) else len(v)
                 for store in (self.tensors, self.non_tensors) for k, v in store.items() if k != key}
        if sizes and set(sizes.values()) != {len(value)}:
            raise ValueError(f"Batch fields disagree on the batch size: field {key!r} has {len(value)} rows, "
                             f"the others {sizes}")
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        (self.tensors if isinstance(value, torch.Tensor) else self.non_tensors)[key] = value

    def select(self, idx: torch.Tensor | np.ndarray | Sequence[int] | slice) -> Batch:
        """Rows `idx` (indices, a boolean mask or a slice) of every field."""
        if isinstance(idx, slice):
            np_idx = idx
            t_idx: Any = idx
        else:
            np_idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx)
            if np_idx.dtype == bool:
                np_idx = np.nonzero(np_idx)[0]
            np_idx = np_idx.astype(np.int64)
            t_idx = torch.from_numpy(np_idx)
        return Batch(
            {k: v[t_idx.to(v.device) if isinstance(t_idx, torch.Tensor) else t_idx] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """`parts` equal chunks; the batch size must divide evenly."""
        if len(self) % parts:
            raise ValueError(f"cannot split a batch of {len(self)} into {parts} equal parts")
        return self.split(len(self) // parts)

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        meta: dict[str, Any] = {}
        for b in batches:
            meta.update(b.meta)
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            meta,
        )

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row `n` times: `a a b b` (interleave, how `rollout.n` samples are laid out) or `a b a b`."""
        idx = np.arange(len(self))
        idx = np.repeat(idx, n) if interleave else np.tile(idx, n)
        return self.select(idx)

    def update(self, other: Batch) -> Batch:
        """Add (or replace) the fields of `other`, which must have the same rows."""
        if len(other) != len(self) and len(other):
            raise ValueError(f"cannot merge a batch of {len(other)} rows into one of {len(self)}")
        self.tensors.update(other.tensors)
        self.non_tensors.update(other.non_tensors)
        self.meta.update(other.meta)
        return self

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors), dict(self.meta))
