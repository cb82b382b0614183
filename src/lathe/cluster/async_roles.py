"""The driver's handle on fully-asynchronous training's rollout replicas (`lathe.workers.fully_async`): requests in,
finished requests out, pause/resume around a weight sync."""

from __future__ import annotations

from lathe.batch import Batch
from lathe.cluster.roles import generate_over_ranks
from lathe.generation import SamplingParams
from lathe.workers.fully_async import ROLLOUT


class RolloutGroup:
    """The driver's handle on the rollout replicas: requests in, finished requests out, pause/resume for a sync.
    A replica is `tp` consecutive ranks (`rollout.tensor_model_parallel_size`); the driver talks to its first rank
    (the leader), which leads the others (`lathe.workers.lockstep`). `world`: the number of replicas."""

    def __init__(self, group, *, pad_id: int, timeout_s: float, tp: int = 1):
        if group.world_size % tp:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the rollout "
                             f"pool's {group.world_size} ranks (rollout.nnodes x rollout.n_gpus_per_node)")
        self.group, self.pad_id, self.timeout_s, self.tp = group, pad_id, timeout_s, tp
        self.world = group.world_size // tp

    def watch(self) -> None:
        """Keep a `RolloutWorker.watch` call running on every rank (`RayWorkerGroup.watch`): a rank whose engine
        thread fails (an engine step that raised, on a follower too) ends the driver's wait in any call to the
        replicas at once, with its rank and error, where the leaders the driver waits for (pausing, validating) would
        wait for it inside the step's collectives till nccl_timeout and then name themselves."""
        self.group.watch(self.group.submit_each(ROLLOUT, "watch", [((), {})] * self.group.world_size),
                         "its engine thread")

    def leaders(self, per_replica: list) -> list:
        """Per-rank calls of `call_each` from per-replica ones: each replica's to its leader, None to followers."""
        out: list = [None] * self.group.world_size
        out[::self.tp] = per_replica
        return out

    def submit(self, requests: dict[int, list]) -> None:
        """`{replica: [(request_id, prompt ids, params, first_index, multi_modal_inputs), ...]}`."""
        self.group.call_each(ROLLOUT, "submit", self.leaders([((requests[r],), {}) if r in requests else None
                                                              for r in range(self.world)]))

    def collect(self, wait_s: float) -> tuple[list[tuple[object, Batch]], list[float]]:
        """Finished requests of every replica (each replica waits up to `wait_s` for one) and their busy seconds.
        (Followers answer at once with nothing, or with what failed them.)"""
        answers = self.group.call(ROLLOUT, "collect", wait_s)
        return [d for a in answers for d in a["done"]], [a["busy_s"] for a in answers[::self.tp]]

    def pause(self, partial: bool) -> int:
        return sum(a for a in self.group.call_each(ROLLOUT, "pause", self.leaders(
            [((partial, self.timeout_s), {})] * self.world)) if a is not None)

    def resume(self) -> None:
        self.group.call_each(ROLLOUT, "resume", self.leaders([((), {})] * self.world))

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        """A blocking rollout split over the replicas (validation), while they stream the training requests."""
        return generate_over_ranks(self.group, ROLLOUT, prompts, params, self.pad_id, replica_size=self.tp)
