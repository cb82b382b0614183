"""The agent loop on an engine that something else steps: a fully-async rollout replica (`lathe.workers.fully_async`).

`AgentLoop.generate` owns its engine for one call and steps it until every trajectory is done. A replica's engine
thread steps its engine without end, and requests (each a chunk of prompts, `n` trajectories each) arrive at any
time; `AgentStream` keeps the trajectories of all of them in flight at once:

    add(request) ──> turn 0 of each trajectory queued in the engine
    on_finished(engine.pop_finished()) ──> turns appended, tool calls started in the stream's thread pool
    advance() ──> answered trajectories get their next turn queued
    each returns the requests whose trajectories are all done, as `(request_id, AgentOutput)`

The same `AgentLoop` methods do the work as in `generate` (seeds, tokens, masks, tool answers), so a request samples
what one `generate` call for it samples. A weight sync pauses the engine thread between two of these calls: a turn
in progress is interrupted and continues under the new weights (`LatheEngine.interrupt`), each of its tokens keeping
the version that sampled it; tool calls in flight keep running in their threads, and their answers are appended
when the thread resumes. A trajectory's `versions` give every token's version (appended tokens: the last model
token's), so its oldest is its first token's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lathe.rollout.agent.loop import AgentCall, AgentLoop, AgentOutput, Trajectory


class AgentStream:
    """Multi-turn trajectories of streamed requests on `loop.engine` (see the module docstring). Every method but
    `ready`, `busy` and `close` is called from the thread that steps the engine. `on_answer` is called (from a tool
    thread) when a tool call or a simulated user's answer finishes, to wake that thread."""

    def __init__(self, loop: AgentLoop, on_answer: Callable[[], None]):
        self.loop, self.on_answer = loop, on_answer
        scheduler = getattr(loop.engine, "scheduler", None)
        if scheduler is not None:           # next turns arrive one by one: batch their prefills (as `generate` does)
            scheduler.prefill_interval = loop.settings.prefill_interval
        self.pool = ThreadPoolExecutor(max_workers=max(1, loop.settings.max_concurrent_tool_calls),
                                       thread_name_prefix="lathe-tool")
        loop._pool = self.pool
        self.calls: dict[str, tuple[object, AgentCall]] = {}     # prefix -> (request id, its trajectories)
        self.left: dict[str, int] = {}                           # prefix -> trajectories not done
        self.live: dict[tuple[str, int], Trajectory] = {}
        self.waiting: set[Trajectory] = set()                    # tool calls (or a user's answer) running
        self._done: list[tuple[object, AgentOutput]] = []

    def add(self, request_id, prompts: list[list[int]], params, *, first_index: int, agent: dict | None,
            multi_modal_inputs: list[dict | None] | None = None) -> None:
        """Queue a request's trajectories (`agent`: `agent_kwargs` of its prompts: tools, users, messages;
        `multi_modal_inputs`: a VL model's images, one entry per prompt, prepared once for all their turns: a weight
        sync drops their embeddings wherever they are held, so the next turn encodes them with the new tower)."""
        call = self.loop.open(prompts, params, first_index=first_index, multi_modal_inputs=multi_modal_inputs,
                              **(agent or {}))
        self.calls[call.prefix] = (request_id, call)
        self.left[call.prefix] = len(call.trajs)
        if not call.trajs:
            self._finish_call(call.prefix)
        for t in call.trajs:
            self.live[(call.prefix, t.index)] = t
            self.loop._submit(t)

    def on_finished(self, finished: list[tuple]) -> list[tuple[object, AgentOutput]]:
        """The engine's finished turns (`pop_finished`): appended, their tool calls started."""
        for (prefix, index, turn), out in finished:
            t = self.live[(prefix, index)]
            if not self.loop._on_turn(t, out, turn=turn):
                self._finish(t)
            elif t.pending or t.parse_errors:
                self.waiting.add(t)
                for f in t.pending:
                    f.add_done_callback(lambda _: self.on_answer())
        return self._take()

    def advance(self) -> list[tuple[object, AgentOutput]]:
        """Trajectories whose answers are in: appended, their next turn queued."""
        for t in sorted((t for t in self.waiting if all(f.done() for f in t.pending)),
                        key=lambda t: (t.call.prefix, t.index)):
            self.waiting.discard(t)
            if not self.loop._on_answers(t):
                self._finish(t)
        return self._take()

    def ready(self) -> bool:
        """A trajectory's answers are in (`advance` has work)."""
        return any(all(f.done() for f in t.pending) for t in list(self.waiting))

    def busy(self) -> bool:
        """A trajectory is not done (generating, or waiting for its tools)."""
        return bool(self.live)

    def close(self) -> None:
        for t in self.live.values():
            self.loop._close(t)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _finish(self, t: Trajectory) -> None:
        del self.live[(t.call.prefix, t.index)]
        self.left[t.call.prefix] -= 1
        if not self.left[t.call.prefix]:
            self._finish_call(t.call.prefix)

    def _finish_call(self, prefix: str) -> None:
        del self.left[prefix]
        request_id, call = self.calls.pop(prefix)
        self._done.append((request_id, self.loop.output(call)))

    def _take(self) -> list[tuple[object, AgentOutput]]:
        out, self._done = self._done, []
        return out
