"""The driver's handle on fully-asynchronous training's rollout replicas (`lathe.workers.fully_async`): requests in,
finished requests out, pause/resume around a weight sync."""

from __future__ import annotations

from lathe.batch import Batch
from lathe.cluster.roles import generate_over_ranks
from lathe.generation import SamplingParams
from lathe.workers.fully_async import ROLLOUT


class RolloutGroup:
    """The driver's handle on the rollout replicas: requests in, finished requests out, pause/resume for a sync."""

    def __init__(self, group, *, pad_id: int, timeout_s: float):
        self.group, self.pad_id, self.timeout_s = group, pad_id, timeout_s
        self.world = group.world_size

    def submit(self, requests: dict[int, list]) -> None:
        """`{replica: [(request_id, prompt ids, params, first_index, multi_modal_inputs), ...]}`."""
        self.group.call_each(ROLLOUT, "submit", [((requests[r],), {}) if r in requests else None
                                                 for r in range(self.world)])

    def collect(self, wait_s: float) -> tuple[list[tuple[object, Batch]], list[float]]:
        """Finished requests of every replica (each replica waits up to `wait_s` for one) and their busy seconds."""
        answers = self.group.call(ROLLOUT, "collect", wait_s)
        return [d for a in answers for d in a["done"]], [a["busy_s"] for a in answers]

    def pause(self, partial: bool) -> int:
        return sum(self.group.call(ROLLOUT, "pause", partial, self.timeout_s))

    def resume(self) -> None:
        self.group.call(ROLLOUT, "resume")

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        """A blocking rollout split over the replicas (validation), while they stream the training requests."""
        return generate_over_ranks(self.group, ROLLOUT, prompts, params, self.pad_id)
