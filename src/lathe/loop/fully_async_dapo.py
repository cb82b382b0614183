"""DAPO's dynamic sampling in fully-asynchronous training (`algorithm.filter_groups.enable`).

The synchronous loop (`lathe.loop.sampling.sample_step_batch`) builds a step from generation rounds of
`data.gen_batch_size` prompts: it drops the groups whose `filter_groups.metric` is constant (no GRPO signal), generates
another round while fewer than `train_batch_size` prompts are kept, at most `max_num_gen_batches` rounds, and trains
the first `train_batch_size` kept groups (the rest of the last round is dropped). Here each rollout request is one
such round, labelled with the step it is generated for: the groups are filtered on the driver as each request
arrives, a step short of kept prompts (counting the rounds still running as if all their groups were kept) gets the
next request before any later step, and the trainer takes a step once the kept groups of its rounds, in issue order
and without a gap, fill it. The dropped groups' prompts go back to the Rollouter's budget (they will not be trained),
so the staleness bound counts trained prompts as without filtering. With `staleness_threshold=0` and one update per
sync this is the synchronous loop's dynamic sampling: the same rounds, seeded by (step, round) as it seeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lathe.algo import filter_groups
from lathe.batch import Batch
from lathe.loop.sampling import DynamicSamplingExhausted, group_metric
from lathe.rollout.base import concat_rollouts


@dataclass
class StepRounds:
    """The rounds (requests) generated for one training step."""

    chunks: list[int] = field(default_factory=list)     # each round's first issue index, in issue order
    expected: int = 0                                     # prompts issued for the step less those dropped


class DynamicSampling:
    """The driver's side of dynamic sampling (see the module docstring)."""

    def __init__(self, fg, *, step_prompts: int, n: int, first_step: int):
        self.metric, self.max_rounds = fg.metric, fg.max_num_gen_batches
        self.step_prompts, self.n = step_prompts, n
        self.next_step = first_step                       # the step the trainer takes next
        self.steps: dict[int, StepRounds] = {}
        self.label_of: dict[int, tuple[int, int]] = {}   # a round's first issue index -> (step, round)
        self.kept: dict[int, Batch] = {}                 # an arrived round's kept groups, by its first issue index
        self.dropped = self.discarded = 0                # groups since the last step taken

    def label(self) -> tuple[int, int]:
        """(step, round) of the next request: the oldest step short of kept prompts, else a new step. Round numbers
        are the synchronous loop's (0, then 2, 3, ...: its seeds). Raises when that step has had its
        `max_num_gen_batches` rounds already."""
        step = next((s for s in sorted(self.steps) if self.steps[s].expected < self.step_prompts),
                    max(self.steps, default=self.next_step - 1) + 1)
        rounds = self.steps.get(step, StepRounds())
        if 0 < self.max_rounds <= len(rounds.chunks):
            raise DynamicSamplingExhausted(
                f"algorithm.filter_groups: after {len(rounds.chunks)} generation rounds (max_num_gen_batches="
                f"{self.max_rounds}) for step {step}, at most {rounds.expected} of its {self.step_prompts} prompts "
                "have reward variance within their group. The policy is solving (or failing) nearly every prompt: "
                "raise max_num_gen_batches (0 = no limit), use harder/easier data, or disable filter_groups.")
        return step, len(rounds.chunks) + 1 if rounds.chunks else 0

    def issued(self, first: int, label: tuple[int, int], prompts: int) -> None:
        rounds = self.steps.setdefault(label[0], StepRounds())
        rounds.chunks.append(first)
        rounds.expected += prompts
        self.label_of[first] = label

    def arrived(self, first: int, batch: Batch) -> list[int]:
        """Filter an arrived round (its rows carry `meta["indices"]`, one issue index per group); returns the issue
        indices of the groups it will never train: dropped, or all of them when its step was taken already."""
        step, _ = self.label_of[first]
        indices = batch.meta["indices"]
        if step < self.next_step:                     # a round still running when its step filled
            del self.label_of[first]
            self.discarded += len(indices)
            return list(indices)
        keep = filter_groups(batch["uid"], group_metric(batch, self.metric))
        groups = keep.reshape(len(indices), self.n)[:, 0].tolist()
        kept = batch.select(keep)
        kept.meta = {**batch.meta, "indices": [i for i, k in zip(indices, groups) if k]}
        self.kept[first] = kept
        dropped = [i for i, k in zip(indices, groups) if not k]
        self.steps[step].expected -= len(dropped)
        self.dropped += len(dropped)
        return dropped

    def _prefix(self) -> tuple[list[int], int]:
        """The next step's arrived rounds in issue order up to the first one still running, and their kept prompts."""
        chunks, have = [], 0
        for c in self.steps.get(self.next_step, StepRounds()).chunks:
            if c not in self.kept or have >= self.step_prompts:
                break
            chunks.append(c)
            have += len(self.kept[c]) // self.n
        return chunks, have

    def ready(self) -> bool:
        return self._prefix()[1] >= self.step_prompts

    def queued_prompts(self) -> int:
        return sum(len(b) for b in self.kept.values()) // self.n

    def pending(self) -> set[int]:
        """Issue indices kept and not yet trained (a checkpoint must re-issue them)."""
        return {i for b in self.kept.values() for i in b.meta["indices"]}

    def take(self, pad_id: int) -> tuple[Batch, list[int], dict[str, float]]:
        """The next step's batch (its first `step_prompts` kept groups, in issue order), the issue indices of its
        other groups (never trained: the kept ones beyond the step, arrived rounds after them), and its metrics."""
        rounds, parts = self.steps.pop(self.next_step), []
        for c in rounds.chunks:                 # in issue order: the gap-free prefix that fills the step comes first
            if c in self.kept:
                parts.append(self.kept.pop(c))
                del self.label_of[c]
            # (a round still running keeps its label: it is discarded when it arrives)
        indices = [i for p in parts for i in p.meta["indices"]]
        trained, surplus = indices[:self.step_prompts], indices[self.step_prompts:]
        batch = concat_rollouts(parts, pad_id).select(slice(0, self.step_prompts * self.n))
        batch.meta["indices"] = trained
        metrics = {"train/num_gen_batches": len(rounds.chunks), "fully_async/dapo/dropped_groups": self.dropped,
                   "fully_async/dapo/discarded_groups": self.discarded + len(surplus)}
        self.next_step += 1
        self.dropped = self.discarded = 0
        return batch, surplus, metrics
