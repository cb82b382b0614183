"""A tensor-parallel rollout replica's ranks in lockstep (fully-async training, `lathe.workers.fully_async`).

The `tp` ranks of a replica each hold a slice of the model (`lathe.engine.tensor_parallel`), so every engine step
runs on all of them at once, on the same sequences: their schedulers must take the same decisions. Only the
replica's leader (its first rank) hears from the driver; before each engine action it tells its followers what to do,
one small pickled message over a gloo group of the replica's ranks, and every rank then does it:

    leader:    step(new requests)  dp_idle()  interrupt()  load(args)  idle()  stop()  abort(error)
    follower:  follow() ... the same actions, in the same order, until "stop" (or "abort": it raises the
               leader's error, naming the leader, instead of waiting out its timeout)

A "step" carries the requests the leader added since its last step (ids, prompts, sampling params with their seeds,
first indices; the leader adds them to its own engine at once, `add`, so that a refused one raises before the step's
collectives, which a replica of data-parallel attention shares with the others) and the leader scheduler's prefill
interval (the agent loop sets it for its calls), so each rank adds the same sequences, admits them at the same step
and samples the same tokens (the logits are gathered whole on every rank). "load" carries what the ranks need to
receive a weight sync (each rank then receives its slices over the group of its tensor-parallel position,
`lathe.workers.reshard`). "idle" is a heartbeat the idle leader sends so that a waiting follower can tell a quiet
leader from a dead one. "dp_idle" (data-parallel attention, `lathe.engine.data_parallel`: a replica with nothing to
run while another replica steps) has every rank's experts take part in the step of the ranks at its tensor-parallel
position in the other replicas; the leaders agree among themselves when to step (the agent loop's lockstep), and
their followers do what they are told.

A loop that adds its own requests between steps (the multi-turn agent loop, `lathe.rollout.agent`) runs on the
leader alone, over `ReplicaEngine`: the engine seen through the lockstep, whose `add_request` adds to the leader's
engine and queues for the next "step" message. Its tool calls and simulated users therefore run once per replica, on
the leader, and when a trajectory's answers are in is decided there; a follower never sees a tool, only the requests
that follow from its answers, in the leader's order, at the leader's step (as vLLM's driver worker broadcasts its
scheduler's inputs). `Lockstep.run` is a synchronous call of such a loop on every rank: the leader runs it, then
says "stop"; a follower follows until then.

Every message also carries a digest of all the outputs the leader's engine returned so far; a follower compares it
with its own, so ranks that drifted apart fail at once, naming themselves. Every wait has the group's timeout; a
follower that hears nothing names its leader. A rank that fails inside a step cannot tell the others, who wait inside
the step's collectives: in fully-async training the driver hears of it from that rank at once (`lathe.workers.
fully_async.RolloutWorker.watch`) and stops the replica.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lathe.engine.tensor_parallel import TensorParallel

HEARTBEAT_S = 30.0          # an idle leader tells its followers it lives at least this often (or timeout / 4)


def control_groups(size: int, timeout_s: float):
    """The gloo group of this rank's replica (consecutive blocks of `size` ranks of the default group; every rank
    calls it, in the same order), or None with `size` 1."""
    if size == 1:
        return None
    group, _ = dist.new_subgroups(group_size=size, backend="gloo", timeout=timedelta(seconds=timeout_s))
    return group


class Lockstep:
    """One rank's side of its replica's lockstep over `engine` (see the module docstring). With `tp.size` 1 (no
    `group`) the leader's actions run the engine alone."""

    def __init__(self, engine, tp: TensorParallel, group, *, timeout_s: float):
        self.engine, self.tp, self.group, self.timeout_s = engine, tp, group, timeout_s
        self.leader = tp.rank == 0
        rank = dist.get_rank() if group is not None else 0
        self.leader_rank = rank - tp.rank            # (global rank of the leader: the broadcasts' source)
        self.who = (f"rank {rank} (rank {tp.rank} of the tensor-parallel rollout replica of ranks "
                    f"{self.leader_rank}..{self.leader_rank + tp.size - 1})")
        self.digest = b""                            # of every output popped so far
        self.heartbeat_s = min(HEARTBEAT_S, timeout_s / 4)
        self.sent_at = time.monotonic()
        self._unsent: list[tuple] = []               # (the leader) requests added, its followers to add at "step"

    def heartbeat_in(self) -> float | None:
        """(The leader.) Seconds until an idle leader owes its followers a heartbeat (`idle`); None: it never does."""
        if self.group is None:
            return None
        return self.heartbeat_s - (time.monotonic() - self.sent_at)

    # -- the leader ------------------------------------------------------------------------------------------------
    def add(self, requests: list[tuple]) -> None:
        """Add `(request_id, prompt ids, params, first_index, multi_modal_inputs, ...)` requests to the leader's
        engine now, where a refusal raises (a prompt past max_model_len, say) before any step's collectives, and
        keep them for the followers, who add them with the next "step" (before their step, as the leader's engine
        stands now: no engine action comes between; `_send` refuses one)."""
        if not self.leader:
            raise RuntimeError(f"{self.who}: a follower adds requests only at its leader's step (this is a bug)")
        for request in requests:                # (one by one: the followers get those taken before a refusal)
            self._add([request])
            self._unsent.append(request[:5])

    @property
    def unsent(self) -> bool:
        """(The leader.) Whether requests it added wait for the next step to reach its followers."""
        return bool(self._unsent)

    def step(self, requests: list[tuple] = ()) -> list[tuple[Any, Any]]:
        """`add(requests)`, then one engine step on every rank of the replica (the followers add what the leader
        added since the last one first); returns the finished `(request_id, output)` pairs."""
        self.add(list(requests))
        unsent, self._unsent = self._unsent, []
        self._send("step", (unsent, self._prefill_interval()))
        return self._step([])

    def run(self, work: Callable[[], Any], receive: Callable[[dict], Any] | None = None) -> Any:
        """Every rank of the replica at once: the leader returns `work()` (whose engine is `ReplicaEngine(self)`)
        and then tells its followers to stop (or, failing, why); a follower follows the leader's actions meanwhile
        (`receive`: a weight sync's, as in `follow`) and returns None, its scheduler's prefill interval as before (the
        leader's loop restores its own; later calls that are not in lockstep must admit alike)."""
        if not self.leader:
            interval = self._prefill_interval()
            try:
                self.follow(receive or self._no_load)
            finally:
                if interval is not None:
                    self.engine.scheduler.prefill_interval = interval
            return None
        try:
            out = work()
        except BaseException as e:
            self.abort(e)
            raise
        self.stop()
        return out

    def _no_load(self, args: dict) -> None:
        raise RuntimeError(f"{self.who}: a weight sync from its leader in the middle of a call (this is a bug)")

    def interrupt(self) -> int:
        """Partial rollout at a weight sync: every rank preempts its unfinished sequences (`engine.interrupt`)."""
        self._send("interrupt")
        return self.engine.interrupt()

    def load(self, args: dict, receive: Callable[[dict], Any]) -> Any:
        """A weight sync: every rank calls `receive(args)` (which loads the weights into its engine)."""
        self._send("load", args)
        return receive(args)

    def idle(self) -> None:
        """A heartbeat: the leader is alive and has nothing to run."""
        self._send("idle")

    def dp_idle(self) -> None:
        """Data-parallel attention, the replica has no sequence this tick: every rank's experts take part in the
        other replicas' step (`LatheEngine.dp_idle`), each with the ranks at its own tensor-parallel position."""
        self._send("dp_idle")
        self.engine.dp_idle()

    def stop(self) -> None:
        self._send("stop")

    def abort(self, error: BaseException) -> None:
        """(The leader, failing.) Tell the followers why, so they stop now rather than at their timeout; best
        effort: a follower that is gone already, or the broadcast that failed, is not waited for again."""
        if self.group is None:
            return
        try:
            self._send("abort", f"{type(error).__name__}: {error}")
        except Exception:      # noqa: BLE001 - failing already: the followers will time out instead
            pass

    def _send(self, kind: str, payload: Any = None) -> None:
        if not self.leader:
            raise RuntimeError(f"{self.who}: a follower acts only on its leader's messages (this is a bug)")
        if self._unsent and kind not in ("step", "idle", "abort"):
            raise RuntimeError(f"{self.who}: a {kind!r} while requests it added wait for its followers: they would "
                               "add them to an engine in another state (this is a bug: step first)")
        if self.group is None:
            return
        self.sent_at = time.monotonic()
        try:
            dist.broadcast_object_list([(kind, payload, self.digest)], src=self.leader_rank, group=self.group)
        except Exception as e:       # noqa: BLE001 - a gloo timeout or a closed connection: say who
            raise RuntimeError(f"{self.who}: its followers did not take the leader's {kind!r} message within "
                               f"{self.timeout_s:.0f} s (actor_rollout_ref.nccl_timeout; a follower that failed "
                               f"logs why): {e}") from e

    def _prefill_interval(self) -> int | None:
        return getattr(getattr(self.engine, "scheduler", None), "prefill_interval", None)

    def _add(self, requests: list[tuple]) -> None:
        for request_id, prompt_ids, params, first_index, images, *_ in requests:
            self.engine.add_request(request_id, prompt_ids, params, first_index=first_index,
                                    multi_modal_inputs=images)

    def _step(self, requests: list[tuple]) -> list[tuple[Any, Any]]:
        self._add(requests)
        self.engine.step()
        done = self.engine.pop_finished()
        if done and self.group is not None:
            self.digest = hashlib.sha256(self.digest + repr([(rid, out.token_ids) for rid, out in done])
                                         .encode()).digest()
        return done

    # -- a follower ------------------------------------------------------------------------------------------------
    def follow(self, receive: Callable[[dict], Any]) -> None:
        """Run the leader's actions until it says "stop" (`receive`: a "load"'s weight sync on this rank)."""
        if self.leader:
            raise RuntimeError(f"{self.who}: the leader takes its actions from the driver (this is a bug)")
        while True:
            kind, payload, digest = self._receive()
            if digest != self.digest:
                raise RuntimeError(f"{self.who}: its engine returned other tokens than its leader's (rank "
                                   f"{self.leader_rank}) from the same requests; this is a bug (their logits or "
                                   "seeds differ)")
            if kind == "stop":
                return
            if kind == "abort":
                raise RuntimeError(f"{self.who}: its leader, rank {self.leader_rank}, failed: {payload}")
            if kind == "step":
                requests, interval = payload
                if interval is not None:            # the leader's scheduler admits as this one must
                    self.engine.scheduler.prefill_interval = interval
                self._step(requests)
            elif kind == "dp_idle":
                self.engine.dp_idle()
            elif kind == "interrupt":
                self.engine.interrupt()
            elif kind == "load":
                receive(payload)
            elif kind != "idle":
                raise RuntimeError(f"{self.who}: an unknown message {kind!r} from its leader (this is a bug)")

    def _receive(self) -> tuple[str, Any, bytes]:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=self.leader_rank, group=self.group)
        except Exception as e:       # noqa: BLE001 - a gloo timeout or a closed connection: say who
            raise TimeoutError(f"{self.who}: no message from its leader, rank {self.leader_rank}, within "
                               f"{self.timeout_s:.0f} s (actor_rollout_ref.nccl_timeout): it failed or stopped "
                               f"answering ({e})") from e
        return box[0]


class ReplicaEngine:
    """The streaming interface of the leader's engine (`LatheEngine.add_request`, `step`, `has_unfinished_requests`,
    `pop_finished`) through its replica's lockstep, for a loop that adds requests between steps (the agent loop):
    the leader's engine takes requests at once, its followers with the next `step`, which sends them. An
    idle leader (its loop waiting for tools) sends a heartbeat when one is due, from `pop_finished` (which such a
    loop calls on every turn of its own loop). Only what such a loop reads besides is passed through."""

    def __init__(self, replica: Lockstep):
        if not replica.leader:
            raise RuntimeError(f"{replica.who}: only a replica's leader runs the loop (this is a bug)")
        self.replica, self.engine = replica, replica.engine
        self._finished: list[tuple] = []

    def add_request(self, request_id, prompt_ids: list[list[int]], params, *, first_index: int = 0,
                    multi_modal_inputs=None) -> None:
        """Added to the leader's engine now (a refusal raises here, as the engine's own `add_request`), to the
        followers' with the next `step`."""
        self.replica.add([(request_id, prompt_ids, params, first_index, multi_modal_inputs)])

    def has_unfinished_requests(self) -> bool:
        return self.replica.unsent or self.engine.has_unfinished_requests()   # (a request of max_tokens 0 is done
                                                                              # at its add: its step returns it)

    def step(self) -> None:
        self._finished += self.replica.step()

    def pop_finished(self) -> list[tuple]:
        due = self.replica.heartbeat_in()
        if due is not None and due <= 0 and not self._finished:
            self.replica.idle()
        out, self._finished = self._finished, []
        return out

    def dp_idle(self) -> None:
        """Data-parallel attention: this replica (nothing queued, nothing running) steps in the others' collectives
        with no sequence, every rank of it (`Lockstep.dp_idle`)."""
        self.replica.dp_idle()

    @property
    def dp(self):
        """The leader engine's place among the data-parallel-attention replicas (the leaders' group: the agent loop
        agrees each tick over it), or None."""
        return getattr(self.engine, "dp", None)

    @property
    def scheduler(self):
        """(Its `prefill_interval` reaches the followers with each step.)"""
        return self.engine.scheduler

    @property
    def eos_ids(self):
        return self.engine.eos_ids

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def prepare_images(self, *args, **kwargs):
        return self.engine.prepare_images(*args, **kwargs)
