"""Ray worker groups: one actor per device, joined into one `torch.distributed` process group, driven by the
single controller.

`RayWorkerGroup` starts a `RankHost` actor in each bundle of a `ResourcePool` (one GPU each, or one CPU slot on a
CPU run), picks the rendezvous (rank 0's node address and a free port there), and has every rank join the
process group (NCCL on GPUs, gloo on CPUs) with `actor_rollout_ref.nccl_timeout` as the collective timeout.
Role workers (the actor/rollout/reference worker, the critic) are then built inside each rank by a factory and
called by name; several roles share a rank (colocated, as verl's hybrid engine does).

Nothing waits forever. Every call the controller waits on has a deadline; when it passes, the error names the
group, the method, the ranks that did not answer (with their hosts) and the last call each rank finished. A
rank that raises ends the call at once with its rank and host added to the error, and a rank whose process
dies (killed, out of memory) ends it with the exit cause Ray reports — the other ranks are not waited for. Those
ranks may be left inside a collective that waits for the lost one (for `actor_rollout_ref.nccl_timeout`): `shutdown`
kills them without asking them to leave the process group first, a request they could only take after that call.
A rank can also fail between the driver's calls, in a thread of its own (fully-async training's rollout replicas
step their engines so, `lathe.workers.fully_async`): such a thread is `watch`ed, and its failure ends whatever call
the driver waits for on the group at once, in the same way, even a call to other ranks that wait for it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lathe import ports

log = logging.getLogger("lathe")


class WorkerGroupError(RuntimeError):
    """A worker group call failed: a rank died or did not answer in time (the message says which)."""


class RankHost:
    """One rank of a worker group (a Ray actor): joins the process group, then builds and runs role workers."""

    def __init__(self, rank: int, world_size: int, num_cpus: float, *, group_name: str = "", use_gpu: bool = False):
        import torch
        self.rank, self.world_size = rank, world_size
        self.group_name, self.use_gpu = group_name, use_gpu
        self.roles: dict[str, Any] = {}
        self.profiler = None            # a running torch profiler (`profile_start`), else None
        self.memory_history = None      # a recording allocator history (`memory_history_start`), else None
        torch.set_num_threads(max(1, int(num_cpus)))
        from lathe.track.progress import TIME_FORMAT, Once
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s",
                            datefmt=TIME_FORMAT)     # Ray prefixes the lines with "(RankHost pid=...)"
        for handler in logging.getLogger().handlers:
            handler.addFilter(Once())
        logging.getLogger("lathe").setLevel(logging.INFO if rank == 0 else logging.WARNING)

    def node(self) -> dict:
        """This rank's Ray node (its address is the one the cluster uses: 127.0.0.1 on a local cluster)."""
        import ray
        node_id = ray.get_runtime_context().get_node_id()
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
                  ray.util.get_node_ip_address())
        return {"ip": ip, "node_id": node_id, "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "gpu_uuid": self._gpu_uuid()}

    def _gpu_uuid(self) -> str | None:
        """NVML's name of this rank's GPU (the driver's energy meter reads it: `lathe.track.energy.for_cluster`)."""
        if not self.use_gpu:
            return None
        from lathe.device import nvidia_uuid
        try:
            return nvidia_uuid(self._device())
        except Exception:   # noqa: BLE001 - a device without a UUID: no energy figures, the run goes on
            return None

    def free_port(self) -> int:
        return ports.free_port()

    def init_process_group(self, address: str, port: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        from lathe.device import set_device
        if backend != "gloo":
            set_device(0)                   # Ray makes this actor's device the only visible one
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))

    def build(self, role: str, factory: Callable, args: tuple, kwargs: dict) -> None:
        self.roles[role] = factory(*args, **kwargs)

    def call(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        if self.profiler is None:
            return getattr(self.roles[role], method)(*args, **kwargs)
        from torch.autograd.profiler import record_function

        from lathe.track.profile import PHASE_PREFIX
        with record_function(f"{PHASE_PREFIX}{role}.{method}"):     # a phase of this rank's profile summary
            return getattr(self.roles[role], method)(*args, **kwargs)

    def profile_start(self, with_stack: bool) -> None:
        """Profile this rank until `profile_stop` (`global_profiler.tool=torch` on a step of a Ray run)."""
        from lathe.track.profile import start
        self.profiler = start(self._device(), with_stack=with_stack)

    def profile_stop(self, step_dir: str) -> dict:
        """Stop the profiler; write this rank's trace and summary under `step_dir/<group>_rank<R>/`; return the
        summary (its phases are the calls the driver made meanwhile)."""
        from pathlib import Path

        from lathe.track.profile import finish
        prof, self.profiler = self.profiler, None
        return finish(prof, self._device(), Path(step_dir) / f"{self.group_name}_rank{self.rank}", rank=self.rank,
                      host=socket.gethostname(), pid=os.getpid())

    def memory_history_start(self, settings: dict) -> None:
        """Record this rank's allocator history until `memory_history_dump` (`global_profiler.tool=torch_memory`)."""
        from lathe.track.memory_history import MemoryHistory
        self.memory_history = MemoryHistory(self._device(), settings)
        self.memory_history.start()

    def memory_history_dump(self, step_dir: str) -> str:
        """Write this rank's snapshot as `step_dir/torch_memory_<group>_rank<R>.pickle`, stop recording; its path."""
        from pathlib import Path

        from lathe.track.memory_history import snapshot_name
        history, self.memory_history = self.memory_history, None
        return str(history.dump(Path(step_dir) / snapshot_name(self.rank, self.group_name)))

    def freeze_collector(self) -> None:
        """Collect once, then keep every object alive now out of the collector's later passes
        (`lathe.track.collector.FreezeAfterWarmup`: the driver asks after its warm-up steps)."""
        import gc
        gc.collect()
        gc.freeze()

    def _device(self):
        from lathe.device import rank_device
        return rank_device("cuda" if self.use_gpu else "cpu")

    def shutdown(self) -> None:
        """Drop the roles (an engine's CUDA graphs hold collectives of the process group: with them alive, 2 H200s
        hung in destroy_process_group), then leave the process group."""
        import gc

        import torch.distributed as dist
        self.roles.clear()
        gc.collect()
        if self.use_gpu:
            from lathe.device import synchronize
            synchronize(self._device())
        if dist.is_initialized():
            dist.destroy_process_group()


class RayWorkerGroup:
    """`world_size` ranks placed on `pool`'s bundles; `call` runs a role's method on every rank."""

    def __init__(self, pool, *, name: str, timeout_s: float, max_concurrency: int = 1):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.name, self.timeout_s, self.pool = name, float(timeout_s), pool
        self.world_size = pool.world_size
        actor = ray.remote(RankHost)
        self.hosts = []
        for rank, (pg, index) in enumerate(pool.bundles()):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
            self.hosts.append(actor.options(num_cpus=pool.cpus_per_worker, num_gpus=1 if pool.use_gpu else 0,
                                            scheduling_strategy=strategy, max_concurrency=max_concurrency)
                              .remote(rank, self.world_size, pool.cpus_per_worker, group_name=name,
                                      use_gpu=pool.use_gpu))
        self.last_done = ["(started)"] * self.world_size
        self.unanswered: dict[int, object] = {}     # rank -> its call left running when a gather failed
        self.watched: dict[object, tuple[int, str]] = {}   # a call left running for the group's life -> (rank, what)
        self.failure: str | None = None             # the first failure a gather reported (which rank, what)
        self.nodes = self._gather([h.node.remote() for h in self.hosts], "node")
        address, port = self.nodes[0]["ip"], self.free_port()
        from lathe.device import backend_for
        backend = backend_for("cuda" if pool.use_gpu else "cpu")
        self._gather([h.init_process_group.remote(address, port, backend, self.timeout_s) for h in self.hosts],
                     "init_process_group")
        log.info("%s: %d workers over %s on %s (rendezvous %s:%d)", name, self.world_size, backend,
                 self.placement(), address, port)

    def free_port(self) -> int:
        """A free TCP port on rank 0's node (for a rendezvous hosted there)."""
        return self._gather([self.hosts[0].free_port.remote()], "free_port")[0]

    def placement(self) -> str:
        """'node 10.0.0.1: ranks 0-1; node 10.0.0.2: ranks 2-3' style summary."""
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(f"node {node['ip']} ({node['node_id'][:8]})", []).append(rank)
        return "; ".join(f"{host}: ranks {','.join(map(str, ranks))}" for host, ranks in by_node.items())

    def host_call(self, method: str, *args) -> list:
        """A `RankHost` method (not a role's) on every rank; the answers in rank order."""
        return self._gather([getattr(h, method).remote(*args) for h in self.hosts], method)

    def build(self, role: str, factory: Callable, *args, **kwargs) -> None:
        """`factory(*args, **kwargs)` on every rank (after the process group exists) becomes `role`."""
        self._gather([h.build.remote(role, factory, args, kwargs) for h in self.hosts], f"build {role}")

    def call(self, role: str, method: str, *args, **kwargs) -> list:
        """The same call on every rank; the answers in rank order."""
        return self.call_each(role, method, [(args, kwargs)] * self.world_size)

    def call_each(self, role: str, method: str, per_rank: Sequence[tuple[tuple, dict] | None]) -> list:
        """Rank r runs `method(*args_r, **kwargs_r)`; a None entry skips that rank (its answer is None)."""
        return self.gather(self.submit_each(role, method, per_rank), f"{role}.{method}")

    def submit_each(self, role: str, method: str, per_rank: Sequence[tuple[tuple, dict] | None]) -> list:
        """`call_each` without waiting: the per-rank Ray references, for `gather` (or `ray.wait`) later."""
        return [None if a is None else h.call.remote(role, method, a[0], a[1]) for h, a in zip(self.hosts, per_rank)]

    def gather(self, refs: list, what: str, watching: RayWorkerGroup | None = None) -> list:
        """The answers of `submit_each`'s references, with the same deadline and error reports as `call`.
        `watching`: another group whose watched calls end this wait too (a weight sync's senders wait for its
        receivers inside a collective: a receiving rank that fails must end the wait for the senders)."""
        return self._gather(refs, what, watching)

    def watch(self, refs: list, what: str) -> None:
        """Watch `submit_each`'s references of calls that run for the group's life (`what`: a rank's engine thread,
        which the call returns from when the thread ends, and raises what failed it): from now on, the first of
        them to raise ends whatever gather the driver waits in, at once, with that rank's error, as a rank raising
        in the call itself does (the ranks the driver waits for may wait for that one inside a collective, till
        actor_rollout_ref.nccl_timeout). A call that returns is watched no more; after the group's first failure
        (`failure`), none is: the driver is stopping the group, and waits for its calls as it did before."""
        self.watched.update({ref: (r, what) for r, ref in enumerate(refs) if ref is not None})

    def _gather(self, refs: list, what: str, watching: RayWorkerGroup | None = None) -> list:
        """Wait for every rank's answer; fail fast on the first error (of the call, or of a watched one, this group's
        or `watching`'s), or name the silent ranks at the deadline."""
        import ray
        from ray.exceptions import GetTimeoutError
        rank_of = {ref: r for r, ref in enumerate(refs) if ref is not None}
        out: list = [None] * len(refs)
        pending = list(rank_of)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            # (after a group's failure its watched calls are not waited on: the driver is stopping it)
            owner = {ref: g for g in (self, watching) if g is not None and not g.failure for ref in list(g.watched)}
            watched = list(owner)
            ready, _ = ray.wait(pending + watched, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._left_running(pending, rank_of)
                silent = sorted(rank_of[p] for p in pending)
                self.failure = self.failure or f"rank(s) {silent} did not answer {what}"
                raise WorkerGroupError(self._silent(silent, what))
            ref = ready[0]
            if ref in owner:                    # (a watched call ended: if it raised, the one waited for is over)
                group = owner[ref]
                entry = group.watched.pop(ref, None)
                if entry is None:               # (another gather took it)
                    continue
                r, thread = entry
                if group is self:
                    self._answer(ref, r, f"{thread}, while the driver waited for {what}", pending, rank_of)
                    continue
                context = f"{thread}, while the driver waited for {self.name}'s {what}"
                try:
                    group._answer(ref, r, context, [], {})
                except BaseException:
                    self._left_running(pending, rank_of)     # (this group's ranks wait for the failed one)
                    raise
                continue
            pending.remove(ref)
            r = rank_of[ref]
            try:
                out[r] = self._answer(ref, r, what, pending, rank_of)
            except GetTimeoutError:      # pragma: no cover - ray.wait said it was ready
                pending.append(ref)
                continue
            self.last_done[r] = what
        return out

    def _answer(self, ref, r: int, what: str, pending: list, rank_of: dict) -> Any:
        """Rank `r`'s answer to `ref` (ready); a rank that raised or died ends the gather (`pending` left running)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        try:
            return ray.get(ref)
        except RayActorError as e:
            self._left_running(pending, rank_of)
            self.failure = self.failure or f"rank {r} died during {what}"
            raise WorkerGroupError(f"{self.name}: rank {r}{self._where(r)} died during {what}: "
                                   f"{_actor_death(e)}. The run cannot continue without it.") from None
        except RayTaskError as e:
            self._left_running(pending, rank_of)
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
            self.failure = self.failure or f"rank {r} raised in {what}: {cause!r}"
            cause.add_note(f"(raised by {self.name} rank {r}{self._where(r)} in {what}; the rank's traceback:\n"
                           f"{_remote_traceback(e)})")
            raise cause from None

    def _left_running(self, pending: list, rank_of: dict) -> None:
        """Remember the calls a failed gather leaves running (for `shutdown`)."""
        self.unanswered.update({rank_of[ref]: ref for ref in pending})

    def _where(self, rank: int) -> str:
        nodes = getattr(self, "nodes", None)
        return f" on {nodes[rank]['host']} ({nodes[rank]['ip']}, pid {nodes[rank]['pid']})" if nodes else ""

    def _silent(self, ranks: list[int], what: str) -> str:
        last = ", ".join(f"rank {r}: {done}" for r, done in enumerate(self.last_done))
        return (f"{self.name}: {what} got no answer within {self.timeout_s:.0f} s from rank(s) "
                f"{', '.join(str(r) + self._where(r) for r in ranks)}. Last call each rank finished: {last}. A rank "
                "stuck in a collective usually means another rank took a different path or died; if the call is "
                "only slow, raise actor_rollout_ref.nccl_timeout (seconds).")

    def shutdown(self) -> None:
        """Leave the process group and stop every rank (best effort: dead ranks are skipped). A rank still inside a
        call that a failed gather left running, or (after a failure) whose watched thread still runs, is killed
        without the request to leave: it would take it only after that call, which may be a collective waiting for a
        lost rank (the request's 10 s went by at each such stop)."""
        import ray
        try:
            left = dict(getattr(self, "unanswered", {}))
            if getattr(self, "failure", None):      # a rank's thread still running may wait for the failed rank
                for ref, (r, _) in getattr(self, "watched", {}).items():
                    left.setdefault(r, ref)
            done, _ = ray.wait(list(left.values()), num_returns=len(left), timeout=0) if left else ([], [])
            asked = [h.shutdown.remote() for r, h in enumerate(self.hosts) if r not in left or left[r] in done]
            if asked:
                ray.wait(asked, num_returns=len(asked), timeout=10)
        except Exception:      # noqa: BLE001 - shutting down after a failure: nothing more to report
            pass
        for h in self.hosts:
            ray.kill(h)
        self.pool.release()


def _actor_death(err: Exception) -> str:
    """The exit cause Ray reports for a dead actor, on one line."""
    text = str(err).strip().splitlines()
    cause = next((line.strip() for line in text if "cause" in line.lower() or "exit" in line.lower()), None)
    return cause or (text[0] if text else type(err).__name__)


def _remote_traceback(err: Exception) -> str:
    """The traceback lines of a RayTaskError (Ray puts the rank's traceback in its message)."""
    text = str(err)
    start = text.find("Traceback (most recent call last)")
    return text[start:].rstrip() if start >= 0 else text.rstrip()
