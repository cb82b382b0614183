"""The two pools of fully-asynchronous training: rollout replicas that generate without pause, trainer ranks that
send them new weights (`lathe.loop.fully_async` drives both).

`RolloutWorker` (one per rollout device) runs lathe's engine in a thread of its own: requests arrive at any time
(`submit`; a vision-language model's carry their prompts' images), the engine steps while any is unfinished, and
finished requests wait in an outbox (`collect`). At a weight sync the driver `pause`s every replica — with partial
rollout the unfinished responses are interrupted (they keep their tokens and log-probs, and continue on the new
weights, their images encoded again by the new vision tower), without it the replica first finishes them — then
the trainer's rank 0 broadcasts the weights in buckets over a process group of its own
(`lathe.workers.checkpoint_engine`) and the replicas load them bucket by bucket, then `resume`. With multi-turn
agent loops the engine thread also runs the requests' trajectories (`AgentStream`): tool calls run in its thread
pool, through a pause too, and wake the thread when they answer; a request is finished when all its trajectories are.

With `rollout.tensor_model_parallel_size` = tp > 1 a replica is tp consecutive ranks of the pool, each holding a
slice of the model (`lathe.engine.tensor_parallel`). The driver talks to each replica's leader (its first rank)
only; the leader's engine thread tells its followers each engine action before it takes it (`lathe.workers.
lockstep`): the requests it adds, a step, an interrupt, a weight sync. At a sync each rank receives only its slices,
over the group of its tensor-parallel position (`lathe.workers.reshard`). A follower's thread only follows: with
multi-turn agent loops the trajectories and their tools are the leader's alone, and their turns reach the followers
as the requests of the step that takes them (`ReplicaEngine`). A rank whose engine step raises leaves the others inside
the step's collectives (till nccl_timeout), unable to hear of it: the driver keeps a `watch` call running on every
rank, which the failed rank's ends at once with its error, and stops the pool.

With data-parallel attention (`rollout.data_parallel_size` D, `expert_parallel_size` D x tp: `lathe.engine.
data_parallel`) the pool's replicas form engines whose every step is a collective of their D replicas: each leader's
engine thread agrees with the others' every tick (`_loop_in_lockstep`), and the weight sync sends whole tensors to
every rank over one group (each rank keeps its slices and its own experts).

`AsyncTrainerWorker` is the trainer's actor/reference worker without an engine, plus the sending side of the
sync. The engine is thread-safe only through the worker's lock: every engine call is made under it.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from lathe.batch import Batch
from lathe.config import LatheConfig
from lathe.config.rules_mtp import speculative_tokens
from lathe.device import rank_device
from lathe.dtypes import rollout_dtype
from lathe.engine.data_parallel import engine_groups, engine_layout
from lathe.engine.tensor_parallel import shard_copy
from lathe.models.vl import is_vl
from lathe.models.frozen import frozen_copy
from lathe.models.lora import is_adapter
from lathe.models.hf import load_policy, select_impl
from lathe.generation import SamplingParams
from lathe.rollout.agent import agent_columns, agent_kwargs, build_agent_loop
from lathe.rollout.agent.custom import CustomAgentLoops, agent_stream, custom_loops_in
from lathe.rollout.base import streamed_batch
from lathe.rollout.build import VERL_BACKENDS, backend_notice, build_engine, eos_token_ids, runs_lathe
from lathe.seeding import seed_everything
from lathe.train import parallel
from lathe.train.vl import check_vl
from lathe.workers.checkpoint_engine import SyncGroup, TensorMeta, receive_weights, send_weights
from lathe.workers.lockstep import Lockstep, ReplicaEngine, control_groups
from lathe.workers.reshard import check_slices, join_as_sender, position_label, send_resharded, sliced_metas

ROLLOUT = "rollout"         # the role name of a replica in its worker group
TICK_S = (0.001, 0.02)      # data-parallel attention: the idle leaders' agreements, from every 1 ms back to 20 ms


class _AfterStep(Exception):
    """A failure after a lockstep tick's engine step (its cause): the other replicas are told at the next agreement."""


class RolloutWorker:
    """A rollout replica: lathe's engine on this rank's device, stepping in a background thread."""

    def __init__(self, cfg: LatheConfig, model_path: str, load_kwargs: dict, tokenizer, *, device_type: str):
        seed_everything(cfg.trainer.seed)
        arr, device = cfg.actor_rollout_ref, rank_device(device_type)
        loaded = load_policy(model_path, **load_kwargs)
        model = select_impl(loaded, arr.model.impl, role="rollout")
        if not runs_lathe(model):
            raise ValueError(f"fully-async training generates with lathe's engine, which runs lathe's own decoder; "
                             f"{type(loaded).__name__} runs on transformers here. Fix: use a Llama/Qwen2/Qwen3 or "
                             "Qwen2.5-VL/Qwen3-VL model (actor_rollout_ref.model.impl=auto), or train synchronously "
                             "(rollout.n_gpus_per_node=0).")
        if arr.rollout.name in VERL_BACKENDS:       # (replicas other than rank 0 log warnings only: once a run)
            logging.getLogger("lathe").info("rollout: lathe engine (%s)", backend_notice(arr.rollout.name))
        if is_vl(model):                # image prompts: each request carries its prompts' images (`submit`), which
            check_vl(model, arr, rollout=True)      # multi-turn trajectories prepare once for all their turns
        self.dtype = rollout_dtype(arr.rollout.dtype, device)
        eos = eos_token_ids(tokenizer, loaded)          # the checkpoint's generation_config (the copy has none)
        size = arr.rollout.tensor_model_parallel_size
        dp_size, ep_size = engine_layout(model, arr.rollout)
        tp, dp = engine_groups(size, dp_size)           # (collective: every rank of the pool builds at once)
        self.dp = dp if dp.size > 1 else None           # data-parallel attention: this replica's place among them
        if size > 1 or self.dp is not None:     # a tensor-parallel replica of `size` consecutive ranks, or the
            engine_model = shard_copy(model, self.dtype, device, tp,    # experts spread over the engine's replicas:
                                      expert_parallel_size=ep_size, dp=dp,     # this rank's slices
                                      keep_mtp=speculative_tokens(arr) > 0)
        else:
            engine_model = frozen_copy(model, self.dtype, device)      # (a VL model: a deep copy, as the workers make)
        del model, loaded
        self.engine = build_engine(arr.rollout, engine_model, eos, engine_model=engine_model, standalone=True,
                                   num_speculative_tokens=speculative_tokens(arr))
        # the replica's ranks run the same engine steps: its leader (first rank) decides, its followers follow
        self.replica = Lockstep(self.engine, tp, control_groups(size, arr.nccl_timeout), timeout_s=arr.nccl_timeout)
        self.pad_id, self.device = tokenizer.pad_token_id, device
        self._cv = threading.Condition()
        # multi-turn (`rollout.multi_turn.enable`): each request's trajectories alternate model turns in this engine
        # and tool calls in the stream's threads, whose answers wake the engine's thread. The leader's alone: its
        # turns reach the engine through the lockstep (`ReplicaEngine`), so a follower adds them at the same step
        # and never runs a tool
        self.agent_engine = ReplicaEngine(self.replica) if self.replica.leader else None
        self.custom_loops = custom_loops_in(arr.rollout)            # (custom agent loops: `CustomStream`)
        self.agent = (agent_stream(build_agent_loop(cfg, self.agent_engine, tokenizer), self._wake)
                      if agent_rollout(arr.rollout) and self.replica.leader else None)
        self.sync: SyncGroup | None = None
        self._inbox: list[tuple] = []
        self._prompts: dict = {}            # request id -> (prompt token ids, n, extra_info) until it is collected
        self._outbox: list[tuple] = []
        self._hold = self._stop = False
        self._paused = False
        self._unfinished = False            # the engine has work, or a trajectory its tools (as of the last step)
        self._stepping = False              # the engine has work (as of the loop's last step)
        self._error: BaseException | None = None
        self._ended = False                 # the engine's thread has returned (or failed: `_error`)
        self._busy_s = 0.0
        loop = self._loop if self.dp is None else self._loop_in_lockstep
        self._thread = threading.Thread(target=self._run, args=(loop if self.replica.leader else self._follow,),
                                        name="lathe-rollout", daemon=True)
        self._thread.start()

    # -- the engine's thread --------------------------------------------------------------------------------
    def _run(self, body) -> None:
        """The thread's `body` (the leader's loop, or a follower's), then `_ended` for the driver's `watch`."""
        try:
            body()
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify_all()

    def _loop(self) -> None:
        """Step the engine while a request is unfinished. The engine is this thread's alone while it runs (other
        threads touch it only while the loop is parked by `pause`); the lock is held to trade requests and results,
        never across a step: a step under it would starve `collect` (Python's lock is not fair) and leave finished
        requests waiting in the outbox while the trainer idles."""
        try:
            while True:
                with self._cv:
                    beat = False            # a tensor-parallel leader idle for a while: tell its followers
                    while not self._stop and (self._hold or not self._has_work()):
                        self._paused = self._hold
                        self._cv.notify_all()
                        due = None if self._hold else self.replica.heartbeat_in()   # (held: the driver's turn)
                        if due is not None and due <= 0:
                            beat = True
                            break
                        self._cv.wait(due)
                    self._paused = False
                    if self._stop:
                        return
                    requests, self._inbox = self._inbox, []
                    self._unfinished = self._unfinished or bool(requests)   # (a pause meanwhile waits for them)
                if beat:                    # (no requests: it had no work)
                    self.replica.idle()
                    continue
                start = time.perf_counter()
                if self.agent is not None:
                    done, unfinished = self._agent_step(requests)
                else:
                    done = self.replica.step(requests)
                    unfinished = self.engine.has_unfinished_requests()
                self._took(done, unfinished, time.perf_counter() - start)
        except BaseException as e:      # noqa: BLE001 - handed to the driver by the next call
            with self._cv:
                self._error = e
                self._cv.notify_all()
            self.replica.abort(e)           # a tensor-parallel leader's followers stop now, with its error

    def _loop_in_lockstep(self) -> None:
        """`_loop` for a replica of data-parallel attention (`lathe.engine.data_parallel`; its leader): every engine
        step is a collective of the engine's replicas, so the leaders agree each tick (over `dp`, the ranks at
        position 0 of every replica) whether any has work, whether all hold, whether any stops or failed. While any
        has work, every replica steps, one without work (or held, its interrupted sequences waiting) in the others'
        collectives (`dp_idle`, told to its followers too); while none has, each waits a tick (1 ms, backing off to
        20 ms) for requests and agrees again. A replica parks for the driver's pause only once every replica holds
        (the driver pauses them all at once); one that is shut down takes part in the others' steps until every
        replica is (the driver shuts them all down at once).
        An error outside a step is told to the others at the next agreement (each raises): the tick's requests are
        added to the engine before it (`Lockstep.add`), so one the engine refuses is such an error. One inside a
        step (the device's, a collective's) leaves them inside the step's collectives (till nccl_timeout): the
        driver hears of it at once from the rank that failed (`watch`), and stops them all."""
        tick, stepping, failed = TICK_S[0], False, None
        try:
            while True:
                with self._cv:
                    if not (stepping or self._stop or self._hold or self._has_work()):
                        self._cv.wait(tick)         # (another replica's request makes all step within a tick)
                    hold, stop = self._hold, self._stop
                    requests, self._inbox = ([], self._inbox) if hold or stop else (self._inbox, [])
                    self._unfinished = self._unfinished or bool(requests)   # (a pause meanwhile waits for them)
                busy = False
                if not (hold or stop) and failed is None:
                    try:                        # (a request the engine refuses raises here, before the step)
                        if self.agent is not None:
                            busy = self._queue_turns(requests)
                        else:
                            self.replica.add(requests)
                            busy = self.replica.unsent or self.engine.has_unfinished_requests()
                    except Exception as e:      # noqa: BLE001 - told to the other replicas first, then raised
                        failed = e
                any_busy, any_unheld, any_running, any_failed = self.dp.agree(
                    [int(busy), int(not hold), int(not stop), int(failed is not None)])
                if any_failed:
                    raise failed or RuntimeError(f"{self.replica.who}: another replica of this data-parallel-"
                                                 "attention engine failed (its error is in its log); this one stops")
                if not any_running:                 # (a stopped replica serves the others' steps until all stop)
                    return
                stepping = bool(any_busy)
                if any_busy:
                    start = time.perf_counter()
                    try:
                        done, unfinished = self._step_in_lockstep(busy)
                    except _AfterStep as e:         # (the step itself ran: the others hear of it next tick)
                        failed, done, unfinished = e.__cause__, [], True
                    self._took(done, unfinished, time.perf_counter() - start if busy else 0.0)
                    tick = TICK_S[0]
                elif not any_unheld:                # every replica holds: the driver's turn
                    with self._cv:
                        self._paused = True
                        self._cv.notify_all()
                        while self._hold and not self._stop:
                            self._cv.wait()
                        self._paused = False
                        if self._stop:              # (all parked: none needs this replica's experts)
                            return
                else:
                    due = self.replica.heartbeat_in()
                    if due is not None and due <= 0:
                        self.replica.idle()         # (its followers hear from it while it waits)
                    tick = min(2 * tick, TICK_S[1])
        except BaseException as e:      # noqa: BLE001 - handed to the driver by the next call
            with self._cv:
                self._error = e
                self._cv.notify_all()
            self.replica.abort(e)

    def _took(self, done: list, unfinished: bool, busy_s: float) -> None:
        """After an engine step: its finished requests out, the work left and the busy seconds noted."""
        with self._cv:
            self._busy_s += busy_s
            self._unfinished, self._stepping = unfinished, self.engine.has_unfinished_requests()
            self._outbox.extend(done)
            if done or not unfinished:
                self._cv.notify_all()

    def _queue_turns(self, requests: list[tuple]) -> bool:
        """Multi-turn in lockstep: new requests' trajectories and answered turns queued; whether a step has work."""
        for request_id, prompt_ids, params, first_index, images, agent in requests:
            self.agent.add(request_id, prompt_ids, params, first_index=first_index, multi_modal_inputs=images,
                           agent={k: v for k, v in agent.items() if k != "extra_info"})
        done = self.agent.advance()             # (a trajectory may end here, with no step: its user stops, say)
        with self._cv:
            self._outbox.extend(done)
            self._unfinished = self.agent.busy()
            if done or not self._unfinished:
                self._cv.notify_all()
        return self.agent_engine.has_unfinished_requests()

    def _step_in_lockstep(self, busy: bool) -> tuple[list, bool]:
        """One tick's engine step of `_loop_in_lockstep` (or an idle one, not `busy`): (finished requests, whether
        any is not)."""
        if self.agent is None:
            done = self.replica.step() if busy else (self.replica.dp_idle() or [])     # (requests added before)
            return done, self.engine.has_unfinished_requests()
        self.agent_engine.step() if busy else self.agent_engine.dp_idle()
        try:
            return self.agent.on_finished(self.agent_engine.pop_finished()), self.agent.busy()
        except Exception as e:      # noqa: BLE001 - a trajectory's (its parser's, its tools'): after the step
            raise _AfterStep() from e

    def _follow(self) -> None:
        """A follower's thread: the leader's engine actions, as it sends them (`Lockstep.follow`)."""
        try:
            self.replica.follow(self._receive)
        except BaseException as e:      # noqa: BLE001 - handed to the driver by the next collect
            logging.getLogger("lathe").error("rollout replica %s failed: %r", self.replica.who, e, exc_info=e)
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _has_work(self) -> bool:
        """(Under the lock.) Requests to add, an engine with work, or a trajectory whose tool answers are in."""
        if self.agent is None:
            return bool(self._inbox or self._unfinished)
        return bool(self._inbox or self._stepping or self.agent.ready())

    def _agent_step(self, requests: list[tuple]) -> tuple[list, bool]:
        """Multi-turn: new requests' trajectories and answered ones' next turns queued, one engine step, finished
        turns appended (`AgentStream`). Returns the finished requests and whether any trajectory is not done."""
        for request_id, prompt_ids, params, first_index, images, agent in requests:
            self.agent.add(request_id, prompt_ids, params, first_index=first_index, multi_modal_inputs=images,
                           agent={k: v for k, v in agent.items() if k != "extra_info"})
        done = self.agent.advance()
        if self.agent_engine.has_unfinished_requests():        # (the followers take the new turns with the step)
            self.agent_engine.step()
        done += self.agent.on_finished(self.agent_engine.pop_finished())
        return done, self.agent.busy()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            who = self.replica.who if self.replica.group is not None else "replica"    # (a rank of a TP replica)
            raise RuntimeError(f"rollout {who}: the engine failed: {self._error!r}") from self._error

    def _leader_only(self, what: str) -> None:
        if not self.replica.leader:
            raise RuntimeError(f"{self.replica.who}: {what} goes to the replica's leader only (the driver's "
                               "RolloutGroup dispatches to leaders; this is a bug)")

    # -- called by the driver -------------------------------------------------------------------------------
    def watch(self) -> None:
        """Return when this rank's engine thread ends, or raise what failed it as soon as it does. The driver keeps
        this call running on every rank (`RolloutGroup.watch`): a rank whose engine step raises leaves the others
        of its replica (and of its data-parallel-attention engine) inside the step's collectives till nccl_timeout,
        so the ranks the driver is waiting for (a leader pausing, say) would not answer before then, nor know why;
        the failed rank's watch ends the driver's wait at once, with its rank and error."""
        with self._cv:
            self._cv.wait_for(lambda: self._ended or self._error is not None)
            self._check()

    def submit(self, requests: list[tuple]) -> None:
        """Queue `(request_id, prompt token ids, params, first_index[, multi_modal_inputs[, agent]])` requests; the
        engine takes them all before its next step (so requests submitted together are batched as one call would
        be). `multi_modal_inputs` (VL models): one entry per prompt, `{"pixel_values", "image_grid_thw"}` (CPU
        tensors) or None for a text prompt, as `LatheEngine.generate` takes them. `agent` (multi-turn):
        `request_agent` of the prompt rows."""
        self._leader_only("submit")
        requests = [(*r, *[None] * (6 - len(r))) for r in requests]
        with self._cv:
            self._check()
            if self.agent is None and any(r[5] is not None for r in requests):
                raise ValueError("rollout replica: a multi-turn request, but this replica was built without "
                                 "actor_rollout_ref.rollout.multi_turn.enable")
            for request_id, prompt_ids, params, _, _, agent in requests:
                if self.agent is not None and agent is None:
                    raise ValueError(f"rollout replica: request {request_id!r} has no `agent` part (request_agent "
                                     "of its prompt rows) and this replica runs multi-turn trajectories")
                self._prompts[request_id] = (prompt_ids, params.n, agent and agent["extra_info"])
            self._inbox.extend(requests)
            self._cv.notify_all()

    def collect(self, wait_s: float = 0.0) -> dict:
        """Finished requests as `(request_id, Batch)` (the response tensors of `to_batch` plus the weight versions
        each response was sampled with), waiting up to `wait_s` for one; and the engine's busy seconds so far. A
        follower of a tensor-parallel replica answers at once, with nothing (its leader returns the outputs), or
        raises what failed its thread."""
        if not self.replica.leader:
            wait_s = 0.0
        with self._cv:
            if not self._outbox and wait_s > 0:
                self._cv.wait_for(lambda: self._outbox or self._error is not None, timeout=wait_s)
            self._check()
            done, self._outbox = self._outbox, []
            busy = self._busy_s
        return {"done": [(rid, self._to_batch(rid, out)) for rid, out in done], "busy_s": busy}

    def _to_batch(self, request_id, out) -> Batch:
        prompt_ids, n, extra_info = self._prompts.pop(request_id)
        batch = streamed_batch(prompt_ids, out, self.pad_id, n, self.engine.weight_version)
        if extra_info is not None:              # multi-turn: the sync loop's columns (tool counts, enriched extra_info)
            batch.update(agent_columns(out, [x for x in extra_info for _ in range(n)]))
        return batch

    def pause(self, partial: bool, timeout_s: float) -> int:
        """Stop between two engine steps. `partial`: interrupt the unfinished responses (returns how many); else
        first let every submitted request finish (nothing new is submitted meanwhile). (A leader: its followers
        interrupt with it.)"""
        self._leader_only("pause")
        with self._cv:
            self._check()
            if not self._cv.wait_for(lambda: not self._paused or self._error is not None, timeout=timeout_s):
                raise TimeoutError(f"rollout replica: the engine did not resume from its last pause within "
                                   f"{timeout_s:.0f} s")     # (a pause right after a resume: one at a time)
            if not partial:
                if not self._cv.wait_for(lambda: self._error is not None or not (self._inbox or self._unfinished),
                                         timeout=timeout_s):
                    raise TimeoutError(f"rollout replica: unfinished requests after {timeout_s:.0f} s of waiting "
                                       "for a weight sync (actor_rollout_ref.nccl_timeout)")
            self._hold = True
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._paused or self._error is not None, timeout=timeout_s):
                raise TimeoutError(f"rollout replica: the engine did not pause within {timeout_s:.0f} s")
            self._check()
            return self.replica.interrupt() if partial else 0

    def resume(self) -> None:
        with self._cv:
            self._hold = False
            self._cv.notify_all()

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the sync's group (with tensor-parallel replicas: the group of this rank's position)."""
        tp = self.replica.tp
        label = (position_label(tp.rank, tp.size) if self.dp is None else  # (data-parallel attention: one group)
                 f"replica {self.dp.rank} of {self.dp.size} of a data-parallel-attention engine, its rank {tp.rank}")
        self.sync = SyncGroup(host, port, rank, world_size, device=self.device, timeout_s=timeout_s, label=label)

    def receive_weights(self, metas: list[TensorMeta], bucket_bytes: int, version: int,
                        position_metas: list[list[TensorMeta]] | None = None) -> dict:
        """Load the trainer's broadcast weights bucket by bucket (paused: no sequence holds KV). A leader's followers
        receive them at once (told by the leader): the whole tensors of `metas`, each rank keeping its slices, or
        with `position_metas` (a resharding sync, `lathe.workers.reshard`) the slices of each rank's position."""
        self._leader_only("receive_weights")
        with self._cv:
            if not self._paused:
                raise RuntimeError("rollout replica: receive_weights needs pause() first")
            return self.replica.load({"metas": metas, "bucket_bytes": bucket_bytes, "version": version,
                                      "position_metas": position_metas}, self._receive)

    def _receive(self, args: dict) -> dict:
        """This rank's side of a weight sync (`Lockstep.load`): whole tensors in (the engine copies its slices), or
        this position's slices (copied as they are)."""
        version, sliced = args["version"], args.get("position_metas")
        metas = args["metas"] if sliced is None else sliced[self.replica.tp.rank]
        if sliced is not None:
            check_slices(self.engine.model, metas, self.replica.who)
        return receive_weights(self.sync, metas, bucket_bytes=args["bucket_bytes"], consume=lambda named:
                               self.engine.load_weights(named, version=version, local=sliced is not None))

    def generate_sequences(self, prompts: Batch, params: SamplingParams, *, first_index: int = 0) -> Batch:
        """A blocking generation (validation): submitted as one request, waited for. A follower of a
        tensor-parallel replica returns None: its leader submits the share and returns the samples."""
        if not self.replica.leader:
            return None
        key = ("blocking", time.monotonic_ns())
        prompt_ids = [list(p) for p in prompts["prompt_ids"]]
        self.submit([(key, prompt_ids, params, first_index, request_images(prompts),
                      request_agent(prompts, self.custom_loops) if self.agent is not None else None)])
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or any(rid == key for rid, _ in self._outbox))
            self._check()
            out = next(o for rid, o in self._outbox if rid == key)
            self._outbox = [(rid, o) for rid, o in self._outbox if rid != key]
        return prompts.repeat(params.n, interleave=True).update(self._to_batch(key, out))

    def shutdown(self, failed: str | None = None) -> None:
        """Stop the engine's thread and close the weight sync. `failed`: a rank of the pool failed (the driver's
        word, `RayWorkerGroup.failure`), so this rank's thread may be inside a step's collectives waiting for it
        (till nccl_timeout): it is not waited for (the worker group's shutdown ends the process next)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30 if failed is None else 0.5)
        if self.replica.leader and self.replica.group is not None and self._error is None \
                and not self._thread.is_alive():
            self.replica.stop()             # (its followers' threads end)
        if self.agent is not None:
            self.agent.close()
        if self.sync is not None:
            self.sync.close()


class AsyncTrainerWorker:
    """The trainer pool's actor/reference worker (no engine) and the sending side of the weight sync."""

    def __init__(self, worker, rollout_dtype: torch.dtype):
        self.worker, self.rollout_dtype = worker, rollout_dtype
        self.syncs: list[SyncGroup] = []        # rank 0's: one group, or one per tensor-parallel position of the
        self.layouts: list | None = None        # replicas, with their `ShardLayout`s (a resharding sync)

    def __getattr__(self, name: str):
        return getattr(self.worker, name)

    def weight_metas(self) -> list[TensorMeta]:
        """(name, full shape, rollout dtype) of every tensor the sync sends, in the order it sends them: every
        parameter, or with LoRA only the adapted layers' merged weights (`W + s B A`; the base never changes, and
        the replicas hold it from the start). A rank of a group lists them without gathering anything."""
        actor = self.worker.actor
        if not actor.sharded:                      # one process (no group): the tensors themselves are at hand
            shapes = [(name, t.shape, t.dtype) for name, t in actor.weights()]
        else:
            shapes = parallel.full_shapes(actor.model)
            if actor.lora:
                adapted = {f"{name[:-len('.lora_A')]}.weight" for name, _ in actor.model.named_parameters()
                           if name.endswith(".lora_A")}
                shapes = [s for s in shapes if s[0] in adapted]
        return [TensorMeta(name, tuple(shape), self.rollout_dtype if dtype.is_floating_point else dtype)
                for name, shape, dtype in shapes]

    def full_weight_bytes(self) -> int:
        """What a sync of every parameter would send, in the rollout dtype (a LoRA sync's yardstick)."""
        actor = self.worker.actor
        shapes = (parallel.full_shapes(actor.model) if actor.sharded
                  else [(name, t.shape, t.dtype) for name, t in actor.model.state_dict().items()])
        return sum(TensorMeta(name, tuple(shape), self.rollout_dtype if dtype.is_floating_point else dtype).nbytes
                   for name, shape, dtype in shapes if not is_adapter(name))

    def join_sync_group(self, host: str, port: int | list[int], rank: int, world_size: int, timeout_s: float,
                        expert_parallel_size: int = 1, keep_mtp: bool = False) -> None:
        """Rank 0 joins the sync's group, or with T ports the T groups of a resharding sync (`join_as_sender`;
        `keep_mtp`: the replicas hold the MTP layers whole)."""
        if parallel.rank() == 0:              # the trainer's rank 0 sends; its other ranks only help gather
            self.syncs, self.layouts = join_as_sender(self.worker.actor.model, host, port, rank, world_size,
                                                      device=self.worker.device, timeout_s=timeout_s,
                                                      expert_parallel_size=expert_parallel_size,
                                                      keep_mtp=keep_mtp)

    def position_metas(self, metas: list[TensorMeta]) -> list[list[TensorMeta]] | None:
        """(Rank 0, after joining.) The metas of each position's slices of a resharding sync; None without one."""
        return None if self.layouts is None else [sliced_metas(layout, metas) for layout in self.layouts]

    def close_sync(self) -> None:
        """Close the sending side of the weight sync (rank 0's; `AsyncCluster.close`, beside the replicas')."""
        for group in self.syncs:
            group.close()
        self.syncs = []

    def send_weights(self, metas: list[TensorMeta], bucket_bytes: int) -> dict:
        """Every trainer rank gathers the sharded weights layer by layer (`Actor.weights`: with LoRA, the adapted
        layers merged); rank 0 broadcasts them in buckets."""
        tensors = self.worker.actor.weights()
        if not self.syncs:
            for _ in tensors:
                pass
            return {}
        if self.layouts is not None:        # tensor-parallel replicas: each position's slices over its own group
            return send_resharded(self.syncs, self.layouts, tensors, metas, bucket_bytes=bucket_bytes)
        stats = send_weights(self.syncs[0], tensors, metas, bucket_bytes=bucket_bytes)
        return {**stats, "rank_bytes": stats["bytes"]}


def request_images(prompts: Batch) -> list | None:
    """The prompt rows' images as a request carries them (`multi_modal_inputs`, one entry per row, None for a text
    row), or None when no row has images."""
    return list(prompts["multi_modal_inputs"]) if "multi_modal_inputs" in prompts else None


def request_agent(prompts: Batch, custom: bool = False) -> dict:
    """What a multi-turn request carries of its prompt rows besides their tokens: `agent_kwargs` (tools, simulated
    users, messages; `custom`: for custom agent loops, the rows' fields too) and the rows' `extra_info` (which the
    replica returns with the loop's additions)."""
    rows = agent_kwargs(prompts, CustomAgentLoops if custom else None)
    return {**rows, "extra_info": list(prompts["extra_info"])}


def agent_rollout(rollout_cfg) -> bool:
    """Whether requests run through an agent loop: the tool loop (`multi_turn.enable`) or custom ones."""
    return rollout_cfg.multi_turn.enable or custom_loops_in(rollout_cfg)
