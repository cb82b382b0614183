"""A resumable data loader: exact resume from (seed, epoch, batch_in_epoch).

The sample order of epoch e is a pure function of (seed, e), so a checkpoint needs only three
integers and a resumed run sees exactly the batches the interrupted run would have seen next.
Batches are lists of dataset items (the rollout step turns them into tensors).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import numpy as np

from lathe.data.errors import DataError


class StatefulDataLoader:
    """Iterates a map-style dataset in batches; `state_dict()` captures the position.

    `epoch` and `batch_in_epoch` always name the *next* batch to be yielded: right after the
    last batch of epoch e is handed out, the state is already (e + 1, 0). So a checkpoint taken
    after any step resumes with the following batch, and one `for batch in loader` walks the
    remainder of the current epoch (a whole epoch when the position is 0).
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True):
        if batch_size < 1:
            raise DataError(f"data.train_batch_size={batch_size}; it must be >= 1")
        size = len(dataset)
        if size == 0 or (drop_last and size < batch_size):
            raise DataError(
                f"a batch of {batch_size} prompts (data.train_batch_size, or data.gen_batch_size with "
                f"algorithm.filter_groups) is larger than the dataset ({size} prompts after filtering), so not "
                "one batch can be formed. Fix: lower that batch size, add data, or raise "
                "data.max_prompt_length / set data.filter_overlong_prompts=False if filtering dropped prompts."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_in_epoch = 0
        self._batches: Iterator[list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order of `epoch`: a permutation seeded by (seed, epoch)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
        return rng.permutation(n)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """Yield the remaining batches of the current epoch, advancing the state as it goes."""
        order = self.epoch_order(self.epoch)
        n_batches = len(self)
        while True:
            start = self.batch_in_epoch * self.batch_size
            batch = [self.dataset[int(i)] for i in order[start:start + self.batch_size]]
            self.batch_in_epoch += 1
            last = self.batch_in_epoch >= n_batches
            if last:
                self.epoch += 1
                self.batch_in_epoch = 0
            yield batch
            if last:
                return

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch, starting the next epoch when one runs out (a trainer's steps)."""
        if self._batches is None:
            self._batches = iter(self)
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self)
            return next(self._batches)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a position saved by `state_dict()`; the saved seed wins (exact resume)."""
        missing = {"epoch", "batch_in_epoch", "seed"} - set(sd)
        if missing:
            raise DataError(f"dataloader state is missing {sorted(missing)}; got keys {sorted(sd)}")
        epoch, pos, seed = int(sd["epoch"]), int(sd["batch_in_epoch"]), int(sd["seed"])
        if epoch < 0 or not 0 <= pos < len(self):
            raise DataError(
                f"dataloader state epoch={epoch}, batch_in_epoch={pos} does not fit this loader "
                f"({len(self)} batches per epoch). Fix: resume with the same data files, filtering "
                "and data.train_batch_size as the checkpointed run."
            )
        if seed != self.seed:
            warnings.warn(
                f"dataloader state was saved with seed {seed}, this run has seed {self.seed}; "
                "using the saved seed so the resumed data order matches the checkpointed run.",
                stacklevel=2,
            )
        self.epoch, self.batch_in_epoch, self.seed = epoch, pos, seed
        self._batches = None                 # the next batch comes from the restored position
