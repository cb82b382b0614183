"""The agent loop: many multi-turn, tool-calling trajectories at once on lathe's engine.

Each trajectory alternates model turns and tool turns until the model stops calling tools, a turn cap
(`max_assistant_turns`, `max_user_turns`) or the response budget (`data.max_response_length`, all turns together)
is reached. Nothing waits for a batch of turns: every model turn is a request streamed into the engine
(`LatheEngine.add_request`, continuous batching beside every other trajectory's turns), and every tool call runs in a
bounded thread pool while the engine keeps stepping. A trajectory's next turn is queued as soon as its tool
answers are in; its prefill finds the conversation so far in the prefix cache (on a hybrid model, in the finished turn
the engine parked: `linear_state.StateBlockManager`).

    model turn ──parse──> tool calls ──threads──> answers ──chat template──> tokens ──> next model turn ...

The response of a trajectory is the concatenation of everything after the prompt; `loss_mask` is 1 on the model's
own tokens and 0 on what the loop appended (the rest of the end-of-turn marker, tool answers, generation prompts),
which come from `ConversationRenderer` exactly as the chat template renders them. Malformed calls, unknown tools,
tool exceptions and timeouts become the tool's answer (an error message the model reads), never a crash.

Images (VL models): a prompt's images sit in the first prompt only. The engine prepares them once per prompt
(`LatheEngine.prepare_images`: encoded, 3D positions), and every turn of its trajectories carries that state, so the
prompt keeps its 3D positions, everything after it (model turns and tool answers) is text at `index + rope_delta`
(as the trainer's `vl_positions` places response tokens), and each turn's prefill finds the last in the prefix cache
(keyed by the images' digest). Tool answers are text: a tool that returns an image stops the run
(`tools.ToolImageError`).

Seeding: turn 0 of sample `i` draws as `LatheEngine.generate(..., first_index=)` draws sample `i`, so with no tool
calls the loop samples exactly what single-turn generation samples; turn `k` uses the run's seed mixed with `k`.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from lathe.engine.llm_engine import sequence_seed
from lathe.engine.speculative import merge_spec_metrics
from lathe.generation import RolloutOutput, SamplingParams
from lathe.rollout.agent.parser import ParsedTurn
from lathe.rollout.agent.render import ConversationRenderer

TRUNCATE_SIDES = ("left", "right", "middle")
# data-parallel attention: while no replica generates, each waits this long for its tools between two agreements
LOCKSTEP_TICK_S = 0.002


@dataclass
class AgentSettings:
    """verl's `rollout.multi_turn` keys the loop reads, plus the response budget."""

    response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1                 # calls of one turn that run; later ones are dropped (verl)
    max_tool_response_length: int = 256         # characters of one tool answer (verl truncates text)
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    max_concurrent_tool_calls: int = 32         # across all trajectories
    prefill_interval: int = 16                  # the engine admits next turns every this many decode steps

    @classmethod
    def from_config(cls, multi_turn_cfg, response_length: int) -> "AgentSettings":
        c = multi_turn_cfg
        return cls(response_length=response_length, max_assistant_turns=c.max_assistant_turns,
                   max_user_turns=c.max_user_turns, max_parallel_calls=c.max_parallel_calls,
                   max_tool_response_length=c.max_tool_response_length,
                   tool_response_truncate_side=c.tool_response_truncate_side, tool_timeout_s=c.tool_timeout,
                   max_concurrent_tool_calls=c.max_concurrent_tool_calls)


@dataclass
class AgentOutput(RolloutOutput):
    """`RolloutOutput` plus, per sample, the loss mask over its response and the trajectory's record."""

    loss_masks: list[list[int]] = field(default_factory=list)
    num_turns: list[int] = field(default_factory=list)          # verl: prompt + model turns + tool turns
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    tool_seconds: list[float] = field(default_factory=list)
    turn_scores: list[list[float]] = field(default_factory=list)   # the simulated user's score of each turn
    tool_rewards: list[dict] = field(default_factory=list)      # each tool's calc_reward, by name
    # custom agent loops (`lathe.rollout.agent.custom`): per sample, the prompt its loop generated from (empty: the
    # data set's), its own score (None: the reward function's) and its extra fields (into the row's extra_info)
    prompt_ids: list[list[int]] = field(default_factory=list)
    reward_scores: list[float | None] = field(default_factory=list)
    extra_fields: list[dict] = field(default_factory=list)


@dataclass(eq=False)
class AgentCall:
    """One `generate` call's trajectories (or one streamed request's, `lathe.rollout.agent.stream`) and what their
    turns share: sampling parameters (n=1), turn 0's seed, the first sample's index, the request ids' prefix."""

    params: SamplingParams
    base: int
    first: int
    prefix: str
    trajs: list["Trajectory"] = field(default_factory=list)
    preemptions: int = 0
    resumed: list[int] = field(default_factory=lambda: [0, 0])   # later turns' prefix-cache hits, prompt tokens
    spec: dict[str, float] = field(default_factory=dict)       # speculative decoding's acceptance, over the turns
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class Trajectory:
    index: int                                  # prompt-major sample index
    prompt: list[int]
    session: object | None                      # the trajectory's ToolSession (None: no tools)
    call: AgentCall | None = None               # (set by `AgentLoop.open`)
    images: object | None = None                # its prompt's images, as the engine prepared them (VL models)
    user: object | None = None                  # its InteractionSession (None: no simulated user)
    messages: list[dict] = field(default_factory=list)   # the conversation, for the simulated user
    turn_scores: list[float] = field(default_factory=list)
    pending_user: bool = False                  # `pending` holds the user's answer, not tool calls
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)   # per token: the weights that sampled it (appended: the last)
    routing: list[torch.Tensor] = field(default_factory=list)   # routing replay R3: the turns' records (`_on_turn`)
    last_turn: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_seconds: float = 0.0
    pending: list[Future] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    rewards: dict = field(default_factory=dict)


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's tool-answer truncation: keep the start (`left`), the end (`right`) or both halves (`middle`)."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


class AgentLoop:
    """Runs trajectories for one `generate` call. `engine`: a `LatheEngine` (its streaming interface); `tools`: a
    `ToolSet` or None; `parse`: a tool-call parser (`lathe.rollout.agent.parser.get_parser`); `interactions`: an
    `InteractionSet` (simulated users, `lathe.rollout.agent.interactions`) or None."""

    def __init__(self, engine, tokenizer, settings: AgentSettings, *, tools=None, parse, renderer=None,
                 interactions=None):
        if settings.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side="
                             f"{settings.tool_response_truncate_side!r}; use one of {TRUNCATE_SIDES}")
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.tools, self.parse, self.interactions = tools, parse, interactions
        self.renderer = renderer or ConversationRenderer(tokenizer, tools=tools.schemas() if tools else None)
        self._stop_ids = set(getattr(engine, "eos_ids", []) or []) | set(self.renderer.stop_ids())
        self._calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int = 0,
                 tools_kwargs: list[dict | None] | None = None, interaction_kwargs: list[dict | None] | None = None,
                 messages: list[list[dict]] | None = None, multi_modal_inputs: list[dict | None] | None = None,
                 request_prefix: str = "agent") -> AgentOutput:
        """`params.n` trajectories per prompt, prompt-major (as `LatheEngine.generate`); `tools_kwargs[i]`: prompt
        i's `extra_info["tools_kwargs"]` (verl: per tool, `create_kwargs` for its instance); `interaction_kwargs[i]`
        its `extra_info["interaction_kwargs"]` and `messages[i]` its chat messages (for the simulated user);
        `multi_modal_inputs[i]` (VL models) its images, as `LatheEngine.generate` takes them: encoded once
        (`LatheEngine.prepare_images`) and carried by every turn of its trajectories, whose tokens after the prompt
        are text."""
        call = self.open(prompts, params, first_index=first_index, tools_kwargs=tools_kwargs,
                         interaction_kwargs=interaction_kwargs, messages=messages,
                         multi_modal_inputs=multi_modal_inputs, request_prefix=request_prefix)
        scheduler = getattr(self.engine, "scheduler", None)
        interval = getattr(scheduler, "prefill_interval", None)
        waited = getattr(self.engine, "device_wait_s", None)      # lathe's engine: the host's wait for the device
        if interval is not None:                # next turns arrive one by one: batch their prefills
            scheduler.prefill_interval = self.settings.prefill_interval
        with ThreadPoolExecutor(max_workers=max(1, self.settings.max_concurrent_tool_calls),
                                thread_name_prefix="lathe-tool") as pool:
            self._pool = pool
            try:
                self._run(call.trajs)
            finally:
                if interval is not None:
                    scheduler.prefill_interval = interval
                for t in call.trajs:
                    self._close(t)
        out = self.output(call)
        if waited is not None and getattr(self.engine, "drafter", None) is None:   # (as LatheEngine.generate reports)
            out.metrics["timing_s/rollout_device_wait"] = self.engine.device_wait_s - waited
        return out

    def open(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int = 0,
             tools_kwargs: list[dict | None] | None = None, interaction_kwargs: list[dict | None] | None = None,
             messages: list[list[dict]] | None = None, multi_modal_inputs: list[dict | None] | None = None,
             request_prefix: str = "agent") -> AgentCall:
        """The trajectories of a `generate` call (arguments as there), their tool sessions open, no turn submitted."""
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        self._calls += 1                                   # trajectory and request ids unique across calls
        call = AgentCall(replace(params, n=1, stop_token_ids=sorted(set(params.stop_token_ids) |
                                                                    set(self.renderer.stop_ids()))),
                         base, first_index, f"{request_prefix}{self._calls}")
        images = self._images(prompts, multi_modal_inputs)
        for i, prompt in enumerate(prompts):
            kwargs = tools_kwargs[i] if tools_kwargs else None
            user_kwargs = interaction_kwargs[i] if interaction_kwargs else None
            conversation = messages[i] if messages else []
            for j in range(params.n):
                index = i * params.n + j
                tid = f"{call.prefix}-{first_index + index}"
                session = self.tools.open(tid, kwargs) if self.tools else None
                user = self.interactions.open(tid, user_kwargs) if self.interactions else None
                call.trajs.append(Trajectory(index, list(prompt), session, call, images[i], user,
                                             [dict(m) for m in conversation]))
        return call

    def _images(self, prompts: list[list[int]], multi_modal_inputs: list[dict | None] | None) -> list:
        """Each prompt's images prepared by the engine (None for a text prompt): every turn reuses them."""
        if multi_modal_inputs is None or all(m is None for m in multi_modal_inputs):
            return [None] * len(prompts)
        if len(multi_modal_inputs) != len(prompts):
            raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries for {len(prompts)} prompts; "
                             "give one per prompt (None for a text prompt)")
        return [self.engine.prepare_images(p, m, where=f"prompt {i}") for i, (p, m) in
                enumerate(zip(prompts, multi_modal_inputs))]

    def serve_replicas(self) -> None:
        """Data-parallel attention, a replica with no prompts this call: it takes part in the other replicas' steps
        until every one's trajectories are done (`_run`'s lockstep)."""
        self._run([])

    # -- the event loop -----------------------------------------------------------------------------------------
    def _run(self, trajs: list[Trajectory]) -> None:
        live = {t.index: t for t in trajs}
        waiting: set[Trajectory] = set()            # trajectories whose tool calls (or user's answer) are running
        dp = getattr(self.engine, "dp", None)       # data-parallel attention: the engine's replicas step together
        failed = None                               # (data-parallel attention: this replica's error, told to all)
        try:
            for t in trajs:
                self._submit(t)
        except Exception as e:
            if dp is None:
                raise
            failed = e
        while live or dp is not None:
            if dp is not None:
                # one tick of the replicas' lockstep: all step (an idle one in the others' collectives) while any
                # generates, else those with tools running wait a moment for them; done when all are; all stop
                # where one failed
                busy = self.engine.has_unfinished_requests()    # (a tensor-parallel leader's: its queued turns too)
                any_busy, any_live, any_failed = dp.agree([int(busy), int(bool(live)), int(failed is not None)])
                if any_failed:
                    if failed is not None:
                        raise failed
                    raise RuntimeError("agent loop: another replica of this data-parallel-attention engine failed "
                                       "(its error is in its log); this replica stops too")
                if any_busy:
                    self.engine.step() if busy else self.engine.dp_idle()
                elif not any_live:
                    break
                elif waiting:
                    wait([f for t in waiting for f in t.pending], timeout=LOCKSTEP_TICK_S,
                         return_when=FIRST_COMPLETED)
                else:
                    time.sleep(LOCKSTEP_TICK_S)
            elif self.engine.has_unfinished_requests():
                self.engine.step()
            elif waiting:
                wait([f for t in waiting for f in t.pending], timeout=self.settings.tool_timeout_s + 5,
                     return_when=FIRST_COMPLETED)
            try:
                self._advance(live, waiting)
            except Exception as e:
                if dp is None:
                    raise
                failed = e

    def _advance(self, live: dict, waiting: set) -> None:
        """`_run`'s work between two engine steps: finished turns read (their tool calls started), answered
        trajectories given their next turn, finished ones dropped from `live`."""
        for key, out in self.engine.pop_finished():
            t = live[key[1]]
            if not self._on_turn(t, out, turn=key[2]):
                del live[t.index]
            elif t.pending or t.parse_errors:
                waiting.add(t)
        for t in sorted((t for t in waiting if all(f.done() for f in t.pending)), key=lambda t: t.index):
            waiting.discard(t)
            if not self._on_answers(t):
                del live[t.index]
        if live and not waiting and not self.engine.has_unfinished_requests():
            raise RuntimeError(f"agent loop: {len(live)} trajectories neither generating nor calling tools "
                               "(an internal error: please report it)")

    def _submit(self, t: Trajectory) -> None:
        turn, call = t.assistant_turns, t.call
        seed = call.base if turn == 0 else sequence_seed(call.base, -turn)
        params = replace(call.params, seed=seed, max_tokens=self.settings.response_length - len(t.ids))
        images = {} if t.images is None else {"multi_modal_inputs": [t.images]}
        self.engine.add_request((call.prefix, t.index, turn), [t.prompt + t.ids], params,
                                first_index=call.first + t.index, **images)

    def _on_turn(self, t: Trajectory, out: RolloutOutput, turn: int) -> bool:
        """A model turn finished: append it (its tokens, log-probs and weight versions); start its tool calls.
        False when the trajectory is done."""
        ids, logprobs, call = out.token_ids[0], out.logprobs[0], t.call
        call.preemptions += out.metrics.get("rollout/num_preemptions", 0)
        merge_spec_metrics(call.spec, out.metrics)
        if turn > 0:                        # a later turn: how much of the conversation the cache held
            call.resumed[0] += out.metrics.get("rollout/prefix_hit_tokens", 0)
            call.resumed[1] += len(t.prompt) + len(t.ids)
        t.versions += per_token_versions(out.versions[0] if out.versions else None, len(ids),
                                     getattr(self.engine, "weight_version", 0))
        if out.routed_experts is not None:      # routing replay R3: the positions this turn fed first
            t.routing.append(out.routed_experts[0][sum(len(r) for r in t.routing):-1])
        t.ids += ids
        t.logprobs += logprobs
        t.mask += [1] * len(ids)
        t.last_turn = list(ids)
        t.assistant_turns += 1
        s = self.settings
        if out.finish_reasons[0] == "length" or len(t.ids) >= s.response_length:
            return self._finish(t, "length")
        parsed = self._parse(ids)
        if t.user is not None:
            t.messages.append({"role": "assistant", "content": self._text(ids)})
        if (s.max_assistant_turns and t.assistant_turns >= s.max_assistant_turns) or (
                s.max_user_turns and t.user_turns >= s.max_user_turns):
            return self._finish(t, "stop")
        if not (parsed.calls or parsed.errors) or self.tools is None:
            if t.user is None:
                return self._finish(t, "stop")
            t.pending, t.pending_user = [self._pool.submit(t.user.respond, list(t.messages))], True
            return True
        calls = parsed.calls[:max(1, s.max_parallel_calls)]
        t.calls += len(calls)
        t.errors += len(parsed.errors)
        t.parse_errors = list(parsed.errors)
        t.pending = [self._pool.submit(t.session.call, c, timeout_s=s.tool_timeout_s) for c in calls]
        return True

    def _body(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] in self._stop_ids else ids

    def _parse(self, ids: list[int]) -> ParsedTurn:
        return self.parse(self.tokenizer.decode(self._body(ids), skip_special_tokens=False))

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(self._body(ids), skip_special_tokens=True)

    def _on_answers(self, t: Trajectory) -> bool:
        """A trajectory's tool answers (or its simulated user's) are in: append them as the template renders them;
        queue its next turn."""
        s = self.settings
        results = [f.result() for f in t.pending]
        t.pending = []
        if t.pending_user:
            t.pending_user, turn = False, results[0]
            t.turn_scores.append(turn.score)
            if turn.terminate:
                return self._finish(t, "stop")
            messages = [{"role": "user", "content": turn.text}]
        else:
            texts = [r.text for r in results] + t.parse_errors
            t.parse_errors = []
            t.errors += sum(r.error for r in results)
            t.tool_seconds += sum(r.seconds for r in results)
            messages = [{"role": "tool", "content": truncate_text(x, s.max_tool_response_length,
                                                                  s.tool_response_truncate_side)} for x in texts]
        if t.user is not None:
            t.messages += messages
        delta = self.renderer.close_turn(t.last_turn) + self.renderer.messages_delta(messages)
        if len(t.ids) + len(delta) >= s.response_length:        # no room for the answers and a next turn
            return self._finish(t, "length")
        t.ids += delta
        t.logprobs += [0.0] * len(delta)
        t.mask += [0] * len(delta)
        t.versions += t.versions[-1:] * len(delta)        # (sampled by none: the last model token's version)
        t.user_turns += 1
        self._submit(t)
        return True

    def _finish(self, t: Trajectory, reason: str) -> bool:
        t.finish_reason = reason
        self._close(t)
        return False

    def _close(self, t: Trajectory) -> None:
        if t.session is not None:
            t.rewards = t.session.rewards()
            t.session.close()
            t.session = None
        if t.user is not None:
            t.user.close()
            t.user = None

    def output(self, call: AgentCall) -> AgentOutput:
        """The call's trajectories as `generate` returns them (each one finished)."""
        trajs = call.trajs
        metrics = {"timing_s/agent_loop": time.perf_counter() - call.start, "rollout/num_preemptions": call.preemptions}
        if call.resumed[1]:     # share of later turns' prompts (the conversation so far) found in the prefix cache
            metrics["agent/prefix_hit_rate"] = call.resumed[0] / call.resumed[1]
        metrics.update(call.spec)
        version = getattr(self.engine, "weight_version", 0)
        routed = [trajectory_routing(t) for t in trajs] if trajs and trajs[0].routing else None
        return AgentOutput(
            token_ids=[t.ids for t in trajs], logprobs=[t.logprobs for t in trajs],
            finish_reasons=[t.finish_reason or "stop" for t in trajs], metrics=metrics,
            versions=[version_spans(t.versions, version) for t in trajs],
            loss_masks=[t.mask for t in trajs], num_turns=[1 + t.assistant_turns + t.user_turns for t in trajs],
            tool_calls=[t.calls for t in trajs], tool_errors=[t.errors for t in trajs],
            tool_seconds=[t.tool_seconds for t in trajs], turn_scores=[t.turn_scores for t in trajs],
            tool_rewards=[t.rewards for t in trajs], routed_experts=routed)


def trajectory_routing(t: Trajectory) -> torch.Tensor:
    """(prompt + response tokens, MoE layers, k) int16: the routing the engine recorded for each token a trajectory
    fed it, stitched from its turns (routing replay R3). Turn k's record (`RolloutOutput.routed_experts`) covers its
    whole sequence, the conversation so far and its response but the last token; of it the trajectory keeps the
    positions this turn fed first: the previous turn's last token, the tool answers, and its own response tokens (the
    earlier ones keep their first turn's routing, the one their log-probs were sampled under). The last token and
    answers appended after the last turn were never fed: -1 (they route by their own top-k)."""
    rows = torch.cat(t.routing)
    tail = len(t.prompt) + len(t.ids) - len(rows)
    return torch.cat([rows, rows.new_full((tail, *rows.shape[1:]), -1)]) if tail > 0 else rows


def per_token_versions(spans: list[tuple[int, int]] | None, length: int, current: int) -> list[int]:
    """Per token, the weight version that sampled it, from one sample's `RolloutOutput.versions` spans ((version,
    first token index), ascending); None: `current` throughout."""
    spans = spans or [(current, 0)]
    out = []
    for k, (version, start) in enumerate(spans):
        end = spans[k + 1][1] if k + 1 < len(spans) else length
        out += [version] * (min(end, length) - start)
    return out


def version_spans(versions: list[int], current: int) -> list[tuple[int, int]]:
    """Per-token versions back to spans (an empty response: `current` from its start)."""
    return [(v, i) for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v] or [(current, 0)]
