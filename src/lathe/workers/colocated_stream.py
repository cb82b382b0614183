"""The colocated engine streaming across training steps (verl V1's `trainer.v1.trainer_mode=colocate_async`).

In each step's rollout phase the driver (`lathe.loop.colocate_async`) adds requests and runs the engine in slices of
engine steps (`run`), taking the requests that finished; once a step's worth of groups has finished it pauses the
engine (`pause`): the unfinished samples are interrupted (their tokens and log-probs kept, their KV freed:
`LatheEngine.interrupt`) and the engine sleeps while the actor trains. The new weights reach it with a new version
(`load_weights`); the interrupted samples continue under them in the next rollout phase (partial rollout), each token
keeping the weight version and the log-prob it was sampled with.

Slices count engine steps, not seconds, so which requests have finished when the driver looks depends on the
requests alone, not on the machine's speed: a run samples and trains the same on a fast device and a busy one.

With an agent loop (the tool loop, `multi_turn.enable`, or custom agent loops) each request runs its trajectories
through the loop's stream (`lathe.rollout.agent.custom.agent_stream`, as a fully-async replica does): a slice's engine
steps run their turns, tool calls run in the stream's threads, and when the engine has nothing to step but
trajectories wait for their tools the slice waits for an answer (up to `answer_timeout_s`). A pause interrupts the
turns in progress (they continue under the next weights); tool calls in flight keep running meanwhile.
"""

from __future__ import annotations

import threading
import time

from lathe.batch import Batch
from lathe.generation import RolloutOutput, SamplingParams
from lathe.rollout.agent import agent_columns
from lathe.rollout.base import streamed_batch


class ColocatedStream:
    """Streamed requests in the colocated engine `engine` (lathe's), across training steps (see the module
    docstring). `wake`/`sleep`: the rollout's own (the KV cache lives only while generating on a GPU, timed into
    its metrics); `pad_id` pads the rows of a finished request."""

    def __init__(self, engine, pad_id: int, *, wake, sleep, agent=None, answer_timeout_s: float = 600.0):
        self.engine, self.pad_id, self._wake, self._sleep = engine, pad_id, wake, sleep
        self.awake = False
        self._answered = threading.Event()
        if agent is not None:               # the agent loop over `engine`: its requests' trajectories stream
            from lathe.rollout.agent.custom import agent_stream
            agent = agent_stream(agent, self._answered.set)
        self.agent, self.answer_timeout_s = agent, answer_timeout_s
        self.prompts: dict = {}             # request id -> (prompt token ids, n, rows' extra_info) until it finishes
        self.outbox: list = []              # requests that finished during a blocking `generate`
        self.busy_s = 0.0                   # seconds spent stepping, in all
        self.timings: dict[str, float] = {}  # the wake-ups' and sleeps' seconds since the last `run` answered

    def run(self, requests: list[tuple], max_steps: int) -> dict:
        """Add `(request_id, prompt token ids, SamplingParams, first_index, multi_modal_inputs)` requests, then run
        up to `max_steps` engine steps (fewer when the engine runs out of work). Returns `{"done": [(request_id,
        Batch)], "busy_s": seconds stepping in all}` with each finished request's rows (`streamed_batch`: the
        weight version of every token)."""
        self.wake()
        for request_id, prompt_ids, params, first_index, images, *agent in requests:
            self._add(request_id, prompt_ids, params, first_index, images, agent=agent[0] if agent else None)
        start = time.perf_counter()
        done, self.outbox = self.outbox, []
        for _ in range(max_steps):
            more = self._step()
            if more is None:
                break
            done += more
        self.busy_s += time.perf_counter() - start
        batches = [(rid, self._rows(rid, out)) for rid, out in done]
        if batches:                         # the wake-ups and sleeps since the last answer ride with its requests
            batches[0][1].meta["rollout_metrics"].update(self.timings)
            self.timings = {}
        return {"done": batches, "busy_s": self.busy_s}

    def pause(self) -> int:
        """Interrupt every unfinished sample (its tokens and log-probs stay, its KV goes) and sleep; returns how
        many were interrupted. They continue at the next `run`, under the weights loaded meanwhile."""
        interrupted = self.engine.interrupt() if self.awake else 0
        self.sleep()
        return interrupted

    def load_weights(self, named_tensors, version: int) -> None:
        """New weights (HF names; tensors the engine shares with the actor are skipped), `version` for the tokens
        sampled from now on. Paused first: no sample holds KV computed with the old ones."""
        if self.awake:
            self.pause()
        self.engine.load_weights(named_tensors, version=version)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, first_index: int = 0,
                 multi_modal_inputs: list | None = None, agent: dict | None = None) -> RolloutOutput:
        """A blocking generation (validation) beside the streamed requests, which run on meanwhile (those that
        finish wait in the outbox for the next `run`); paused again at the end. `agent`: the prompts' `agent_kwargs`
        (with an agent loop: their trajectories run through it)."""
        key = ("blocking", time.monotonic_ns())
        self.wake()
        self._add(key, prompt_ids, params, first_index, multi_modal_inputs, keep=False, agent=agent)
        out = None
        while out is None:
            finished = self._step()
            if finished is None:
                raise RuntimeError("ColocatedStream.generate: the engine and the agent loop ran out of work before "
                                   "the blocking request finished; this is a bug in lathe")
            for rid, o in finished:
                if rid == key:
                    out = o
                else:
                    self.outbox.append((rid, o))
        self.pause()
        return out

    def _step(self) -> list | None:
        """One engine step (with an agent loop: answered trajectories' turns queued first, the finished turns handed
        back after; when only tools are at work, the wait for one's answer); the requests it finished. None once
        there is nothing left to run."""
        if self.agent is None:
            if not self.engine.has_unfinished_requests():
                return None
            self.engine.step()
            return self.engine.pop_finished()
        done = self.agent.advance()
        if self.engine.has_unfinished_requests():
            self.engine.step()
            return done + self.agent.on_finished(self.engine.pop_finished())
        if done:
            return done
        if not self.agent.busy():
            return None
        self._wait_for_answers()
        return []

    def _wait_for_answers(self) -> None:
        """The engine is idle and trajectories wait for their tools (or loops for their environments): until one
        answers, at most `answer_timeout_s`."""
        deadline = time.monotonic() + self.answer_timeout_s
        while not self.agent.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"colocate_async: no tool call or agent loop answered in {self.answer_timeout_s:.0f}"
                                   " s while the engine had nothing to run (the larger of actor_rollout_ref."
                                   "nccl_timeout and rollout.multi_turn.tool_timeout + 60 s)")
            self._answered.wait(timeout=0.05)
            self._answered.clear()

    def wake(self) -> None:
        if not self.awake:
            self._wake(self.timings)
            self.awake = True

    def sleep(self) -> None:
        if self.awake:
            self._sleep(self.timings)
            self.awake = False

    def _add(self, request_id, prompt_ids, params, first_index, images, keep: bool = True,
             agent: dict | None = None) -> None:
        """A request into the engine, or with an agent loop its trajectories into the loop's stream (`agent`:
        `fully_async.request_agent` of its rows, or a blocking call's `agent_kwargs`)."""
        if self.agent is not None:
            if agent is None:
                raise ValueError(f"colocate_async: request {request_id!r} has no agent part and this rollout runs an "
                                 "agent loop; this is a bug in lathe")
            self.agent.add(request_id, prompt_ids, params, first_index=first_index,
                           agent={k: v for k, v in agent.items() if k != "extra_info"})
        else:
            self.engine.add_request(request_id, prompt_ids, params, first_index=first_index,
                                    multi_modal_inputs=images)
        if keep:
            self.prompts[request_id] = (prompt_ids, params.n, agent and agent.get("extra_info"))

    def _rows(self, request_id, out: RolloutOutput) -> Batch:
        prompt_ids, n, extra_info = self.prompts.pop(request_id)
        batch = streamed_batch(prompt_ids, out, self.pad_id, n, self.engine.weight_version)
        if extra_info is not None:      # an agent loop's: the sync loop's columns (tool counts, enriched extra_info)
            batch.update(agent_columns(out, [x for x in extra_info for _ in range(n)]))
        return batch
