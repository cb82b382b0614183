"""verl's custom agent loops on lathe's engine: `actor_rollout_ref.rollout.agent.agent_loop_config_path`.

A verl user writes an agent loop as a class with one coroutine, `run(sampling_params, **row) -> AgentLoopOutput`,
that calls the model through `self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)` (token
ids in, `TokenOutput` out) and does whatever else between calls (tools, environments, a LangGraph graph). The YAML
file at `agent_loop_config_path` lists them:

    - name: math_expression
      _target_: my_pkg.agents.MathExpressionAgentLoop     # imported from the working directory, as verl does
      max_terms: 6                                          # the rest: keyword arguments of the constructor

and a row's `agent_name` column picks one (`agent.default_agent_loop` for rows without it; `single_turn_agent` is
built in). Here every sample's loop runs as a coroutine in one asyncio event loop on the rollout's thread, and the
same thread steps the engine between the coroutines' turns: each `generate` call is one request streamed into the
engine (`LatheEngine.add_request`, continuous batching beside every other sample's), answered when it finishes.

    run() ... await server_manager.generate(...) ──> engine.add_request ──> engine.step() ... ──> pop_finished
      <── TokenOutput(token_ids, log_probs) ───────────────────────────────────────────────────────┘

The loops import from here what they imported from verl (one line changes: `from verl.experimental.agent_loop
import AgentLoopBase, AgentLoopOutput, register` becomes `from lathe.rollout.agent.custom import ...`; a module that
imports verl's is told so). Seeding: the k-th `generate` call of sample i draws as the agent loop's k-th turn of
sample i (`lathe.rollout.agent.loop`), so `single_turn_agent` samples exactly what single-turn generation samples and
a resumed run samples again what it sampled. What a loop returns is checked (lengths, the response budget) and, when
it leaves out `response_logprobs`, they are taken from its `generate` calls where its model tokens are those calls'
tokens in order (else the run stops and says to return them).

On a tensor-parallel engine replica the leader runs the loops over `ReplicaEngine` (`lathe.workers.lockstep`), its
followers following its steps, as the tool loop does. On a fully-async rollout pool's replica (`CustomStream`) the
loops run in an event loop of their own thread, beside the engine's thread that steps without end; each token keeps
the weight version that sampled it.

Not implemented (refused where configured, or stopped when a loop asks for it): images, video and audio
(`image_data`, `multi_modal_data`), routing replay (`routed_experts`), an engine of data-parallel replicas
(`rollout.data_parallel_size`), `agent.custom_async_server`, and rows naming verl's `tool_agent` beside custom loops
(lathe's tool loop, `multi_turn.enable`, runs only when no custom loop is set).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from contextlib import contextmanager
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lathe.engine.llm_engine import sequence_seed
from lathe.generation import RolloutOutput, SamplingParams
from lathe.rollout.agent.loop import AgentOutput, AgentSettings, per_token_versions, version_spans

KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
BUILTIN = "single_turn_agent"
VERL_IMPORT_FIX = ("import them from lathe instead: from lathe.rollout.agent.custom import AgentLoopBase, "
                   "AgentLoopOutput, AgentLoopMetrics, TokenOutput, register, simple_timer, rollout_trace_op")
# vLLM's sampling arguments a loop may pass: lathe's, and those that change nothing here
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "max_new_tokens", "min_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "n"}
IGNORED_SAMPLING_KEYS = {"logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                         "include_stop_str_in_output"}
IDLE_POLL_S = 0.002
PREFILL_INTERVAL = AgentSettings.prefill_interval


class AgentLoopError(RuntimeError):
    """A custom agent loop failed, returned something lathe cannot train on, or asked for what is not implemented."""


# -- verl's data types ---------------------------------------------------------------------------------------------
@dataclass
class AgentLoopMetrics:
    """verl's per-sample timings (seconds) of a loop."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


@dataclass
class TokenOutput:
    """What `server_manager.generate` returns: the sampled tokens and their log-probs (always given by lathe's
    engine); `stop_reason` "completed" (an end token or stop string) or "length"."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentLoopOutput:
    """One sample's trajectory, verl's fields: `response_mask` 1 on the model's tokens, 0 on what the loop appended
    (tool answers...); `reward_score` (optional) is the sample's score, given to the trainer in place of the reward
    function's; `extra_fields` reach the reward function in the row's `extra_info`."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics | dict = field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None

    def __post_init__(self):
        if isinstance(self.metrics, dict):          # (verl's pydantic model takes a dict)
            self.metrics = AgentLoopMetrics(**{k: v for k, v in self.metrics.items() if k in AGENT_METRICS})


AGENT_METRICS = {f.name for f in fields(AgentLoopMetrics)}


class DictConfigWrap:
    """verl's wrapper of a config handed to a loop's constructor (`.config`)."""

    def __init__(self, config):
        self.config = config


class ToolListWrap:
    """verl's wrapper of the run's tools handed to a loop's constructor (`.tools`)."""

    def __init__(self, tools: list):
        self.tools = tools


def _view(value):
    if hasattr(value, "__dataclass_fields__"):
        return ConfigView(value)
    return _AttrDict(value) if isinstance(value, dict) else value


class _AttrDict(dict):
    """A dict whose keys read as attributes too (an OmegaConf mapping node, as verl's loops read one)."""

    def __getattr__(self, name):
        if name not in self:
            raise AttributeError(name)
        return _view(self[name])


class ConfigView:
    """A lathe config group read as verl's loops read an OmegaConf node: attributes, `.get(key, default)`,
    `[key]`; nested groups are views too, dicts mappings with attribute access."""

    def __init__(self, node):
        object.__setattr__(self, "_node", node)

    def __getattr__(self, name):
        return _view(getattr(object.__getattribute__(self, "_node"), name))

    def get(self, name, default=None):
        try:
            return self.__getattr__(name)
        except AttributeError:
            return default

    def __getitem__(self, name):
        try:
            return self.__getattr__(name)
        except AttributeError:
            raise KeyError(name) from None

    def __contains__(self, name):
        return self.get(name, KeyError) is not KeyError


@dataclass
class MergeResult:
    """`ct_merge_*`'s result: the conversation's tokens so far."""

    token_ids: list[int]


# -- the base class and the registry -------------------------------------------------------------------------------
class AgentLoopBase:
    """verl's agent loop base class: subclass it and write `async run(self, sampling_params, **kwargs)`. The
    constructor takes verl's arguments; `self.config` is the run's config (read as OmegaConf is), `self.rollout_config`
    its `actor_rollout_ref.rollout` (with verl's `prompt_length` and `response_length`), `self.server_manager`
    generates, `self.tokenizer` and `self.loop` (the event loop) are there as in verl."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager: "ServerManager", tokenizer, processor=None,
                 dataset_cls=None, data_config: DictConfigWrap | None = None, hf_model_type: str | None = None,
                 **kwargs):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config if data_config is not None else self.config.data
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs") or {})
        self.hf_model_type = hf_model_type
        self.loop = asyncio.get_event_loop()

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        raise NotImplementedError("an agent loop's run(sampling_params, **row) returns an AgentLoopOutput")

    # verl's helpers (text only)
    async def process_vision_info(self, messages: list[dict]) -> dict:
        return await self.process_multi_modal_info(messages)

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        if any(isinstance(m.get("content"), list) for m in messages):
            raise AgentLoopError(_unsupported("a message with images, video or audio (a content list)"))
        return {}

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, images=None,
                                  videos=None, remove_system_prompt: bool = False) -> list[int]:
        """The messages' tokens with the generation prompt (verl's helper; `remove_system_prompt` drops what the
        template prepends to a conversation, for appending later messages)."""
        if images or videos:
            raise AgentLoopError(_unsupported("images or video"))
        ids = self._render(messages, tools)
        if remove_system_prompt:
            ids = ids[len(self._system_prefix(tools)):]
        return ids

    def _system_prefix(self, tools) -> list[int]:
        """The tokens a template puts before a conversation's first message (a default system prompt): one empty
        user message's rendering less the tokens a second one adds."""
        user = {"role": "user", "content": ""}
        one = self._render([user], tools, add_generation_prompt=False)
        two = self._render([user, user], tools, add_generation_prompt=False)
        return one[:max(0, 2 * len(one) - len(two))]

    def _render(self, messages, tools, *, add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,      # (as the data set
                                                  add_generation_prompt=add_generation_prompt,  # renders prompts)
                                                  **self.apply_chat_template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def ct_build_initial_tokens(self, messages: list[dict], tools: list[dict] | None = None, images=None,
                                      videos=None, audios=None) -> list[int]:
        """The prompt's tokens (the chat template with the generation prompt), left-cut to `prompt_length`."""
        if images or videos or audios:
            raise AgentLoopError(_unsupported("images, video or audio"))
        ids = self._render(messages, tools)
        limit = self.rollout_config.prompt_length
        return ids[-limit:] if limit and len(ids) > limit else ids

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: list[float] | None = None,
                                       assistant_logprobs: list[float] | None = None):
        """The model's tokens appended as sampled: mask 1, their log-probs."""
        n = len(assistant_token_ids)
        mask = list(response_mask) + [1] * n
        logprobs = None if response_logprobs is None else (
            list(response_logprobs) + list(assistant_logprobs if assistant_logprobs is not None else [0.0] * n))
        return MergeResult(list(runtime_token_ids) + list(assistant_token_ids)), mask, logprobs

    async def ct_merge_non_assistant_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                         runtime_token_ids: list[int], response_mask: list[int],
                                         response_logprobs: list[float] | None = None,
                                         tools: list[dict] | None = None):
        """The messages after `previous_messages` (tool answers, a user turn) appended as the chat template renders
        them after the last model turn, and the next generation prompt: mask 0 (lathe's `ConversationRenderer`)."""
        added = list(updated_messages)[len(previous_messages):]
        if not previous_messages or previous_messages[-1].get("role") != "assistant":
            raise AgentLoopError("ct_merge_non_assistant_msg: previous_messages must end with the model's turn (an "
                                 "assistant message): lathe appends what follows a model turn, and the next generation "
                                 "prompt, once. Fix: merge all the messages after a model turn in one call")
        renderer = _renderer(self.tokenizer, tools)
        delta = renderer.close_turn(list(runtime_token_ids[-1:])) + renderer.messages_delta(added)
        mask = list(response_mask) + [0] * len(delta)
        logprobs = None if response_logprobs is None else list(response_logprobs) + [0.0] * len(delta)
        return MergeResult(list(runtime_token_ids) + delta), mask, logprobs


@contextmanager
def simple_timer(name: str, timing: dict):
    """verl's timer: the block's seconds into `timing[name]` (a loop's metrics, as `generate_sequences`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = time.perf_counter() - start


def rollout_trace_op(func):
    """verl's rollout-trace decorator: lathe records no traces of a loop (its trajectories are in the batch); the
    function is returned as it is."""
    return func


_RENDERERS: dict = {}


def _renderer(tokenizer, tools: list[dict] | None):
    """A `ConversationRenderer` for the tokenizer and tools, made once (it renders a stand-in conversation)."""
    import json
    from lathe.rollout.agent.render import ConversationRenderer
    key = (id(tokenizer), json.dumps(tools, sort_keys=True, default=str))
    if key not in _RENDERERS:
        if len(_RENDERERS) > 64:
            _RENDERERS.clear()
        _RENDERERS[key] = (tokenizer, ConversationRenderer(tokenizer, tools=tools))   # (holds the tokenizer: the
    return _RENDERERS[key][1]                                                        # id stays its own)


_REGISTRY: dict[str, type] = {}


def register(agent_name: str):
    """verl's decorator: `@register("my_agent")` names a loop class (its module must be imported: list it in the
    agent_loop_config_path file, or import it from one that is)."""
    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise AgentLoopError(f"@register({agent_name!r}): {cls!r} is not a subclass of lathe's AgentLoopBase. "
                                 f"Fix: {VERL_IMPORT_FIX}, and derive the class from AgentLoopBase")
        _REGISTRY[agent_name] = cls
        return cls
    return decorator


@register(BUILTIN)
class SingleTurnAgentLoop(AgentLoopBase):
    """verl's `single_turn_agent`: the row's prompt (as the data set rendered it), one `generate` call."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        prompt_ids = list(kwargs["prompt_ids"])
        start = time.perf_counter()
        out = await self.server_manager.generate(request_id=f"single-{kwargs.get('index')}", prompt_ids=prompt_ids,
                                                 sampling_params=sampling_params)
        n = self.rollout_config.response_length
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids[:n],
                               response_mask=[1] * len(out.token_ids[:n]), response_logprobs=out.log_probs[:n],
                               num_turns=2, metrics={"generate_sequences": time.perf_counter() - start,
                                                     "num_preempted": out.num_preempted or 0})


def _unsupported(what: str) -> str:
    return (f"{what} in a custom agent loop is not implemented yet in lathe (its loops are text-only). Fix: keep "
            f"the loop's prompts and tool answers text, or run image prompts without {KEY}")


def _import_target(target: str, where: str):
    """The class at a dotted `_target_`, imported with the working directory on the path (as verl's hydra does)."""
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise AgentLoopError(f"{where}: _target_={target!r} is not a dotted path. Fix: name the class as "
                             "package.module.ClassName, importable from the directory you run lathe in")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "verl":
            raise AgentLoopError(f"{where}: module {module_name!r} imports verl ({e}); lathe runs verl's agent loops "
                                 f"without verl. Fix: {VERL_IMPORT_FIX}") from None
        raise AgentLoopError(f"{where}: cannot import {module_name!r} for _target_={target!r} ({e}). Fix: run lathe "
                             f"from the directory that holds the package, or add it to PYTHONPATH") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise AgentLoopError(f"{where}: module {module_name!r} has no {name!r}. Fix: name a class it defines")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise AgentLoopError(f"{where}: {target} is not a subclass of lathe's AgentLoopBase. Fix: {VERL_IMPORT_FIX}, "
                             "and derive the class from AgentLoopBase")
    return cls


def load_registry(path: str | None) -> dict[str, tuple[type, dict]]:
    """name -> (class, constructor kwargs): the YAML file's loops, then every `@register`ed one (lathe's built-in
    loop, and those the file's modules register as they are imported) under a name the file does not use."""
    entries: dict[str, dict] = {}
    if path:
        import yaml
        try:
            with open(os.path.expanduser(path)) as f:
                listed = yaml.safe_load(f)
        except OSError as e:
            raise AgentLoopError(f"{KEY}={path!r}: cannot read it ({e.strerror}). Fix: give the path of a YAML list "
                                 "of {name, _target_} entries") from None
        except yaml.YAMLError as e:
            raise AgentLoopError(f"{KEY}={path!r}: not valid YAML ({e})") from None
        if not isinstance(listed, list) or not listed:
            raise AgentLoopError(f"{KEY}={path!r}: expected a non-empty YAML list of entries like "
                                 "'- name: my_agent\\n  _target_: my_pkg.agents.MyAgentLoop', got "
                                 f"{type(listed).__name__}")
        for i, entry in enumerate(listed):
            where = f"{path} entry {i}"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                    entry.get("_target_"), str):
                raise AgentLoopError(f"{where}: expected a mapping with a string 'name' and '_target_', got {entry!r}")
            entries[entry["name"]] = dict(entry)
    out = {}
    for name, spec in entries.items():
        spec = dict(spec)
        spec.pop("name", None)
        out[name] = (_import_target(spec.pop("_target_"), f"agent loop {name!r} ({path})"), spec)
    for name, cls in list(_REGISTRY.items()):           # (after the file's imports: what they registered too)
        out.setdefault(name, (cls, {}))
    return out


# -- the server facade and the runner ------------------------------------------------------------------------------
@dataclass(eq=False)
class _Call:
    """One `generate` call's (or one streamed request's) samples and what their turns share."""

    prefix: str                     # request keys' prefix
    params: SamplingParams
    base: int                       # turn 0's seed
    first: int                      # the first sample's index in the rollout (seeding)
    samples: list = field(default_factory=list)
    request_id: Any = None          # (a streamed request's)
    results: list = field(default_factory=list)
    left: int = 0
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Sample:
    index: int                      # prompt-major, within the call
    row: dict
    name: str
    call: _Call | None = None
    calls: int = 0                  # generate calls so far (turn k's seed)
    generated: list = field(default_factory=list)    # (token ids, log-probs, per-token versions) of each call
    last_finish: str = "stop"


class ServerManager:
    """verl's `server_manager` of one sample: `generate` streams a request into the engine and waits for it."""

    def __init__(self, runner: "CustomAgentLoops", sample: _Sample):
        self._runner, self._sample = runner, sample

    async def generate(self, request_id=None, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       priority: int = 0, **kwargs) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise AgentLoopError(_unsupported("image_data, video_data or audio_data"))
        if kwargs:
            raise AgentLoopError(f"server_manager.generate: arguments {sorted(kwargs)} are not lathe's (it takes "
                                 "request_id, prompt_ids, sampling_params, priority)")
        return await self._runner._generate(self._sample, list(prompt_ids), dict(sampling_params or {}))


class CustomAgentLoops:
    """Runs each sample's agent loop (see the module docstring); `generate` has `AgentLoop.generate`'s contract and
    also takes the prompt rows (`rows`: each prompt's dataset fields, what verl hands `run` as keyword arguments)."""

    takes_rows = True

    def __init__(self, engine, tokenizer, cfg, *, registry: dict, default: str, response_length: int,
                 prompt_length: int, timeout_s: float, tools: list | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        # the loops read verl's rollout.prompt_length / response_length: lathe's null ones filled from data.*
        arr = cfg.actor_rollout_ref
        self.cfg = replace(cfg, actor_rollout_ref=replace(arr, rollout=replace(
            arr.rollout, prompt_length=arr.rollout.prompt_length or prompt_length,
            response_length=arr.rollout.response_length or response_length)))
        self.registry, self.default = registry, default
        self.response_length, self.prompt_length, self.timeout_s = response_length, prompt_length, timeout_s
        self.tools = tools or []
        self._calls = 0
        self._waiting: dict = {}            # request key -> the future its loop awaits
        self._requests = 0                  # requests added so far (progress, for the timeout)
        # how a loop's request reaches the engine: at once (`generate`: this thread steps it), or through a
        # `CustomStream` (the engine's own thread adds it)
        self._submit = self._add_now
        if default not in registry:
            raise AgentLoopError(f"actor_rollout_ref.rollout.agent.default_agent_loop={default!r} is not a loop of "
                                 f"{KEY} (loops: {sorted(registry)}). Fix: list it there or name one of those")

    def open(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int, rows: list[dict] | None,
             multi_modal_inputs: list | None = None, request_prefix: str = "custom") -> _Call:
        """A call's samples (`params.n` per prompt, prompt-major), their loops not started."""
        if multi_modal_inputs is not None and any(m is not None for m in multi_modal_inputs):
            raise AgentLoopError(_unsupported("an image prompt"))
        rows = rows or [{} for _ in prompts]
        self._calls += 1
        base = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        call = _Call(f"{request_prefix}{self._calls}", params, base, first_index)
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            name = row.get("agent_name") or self.default
            if name not in self.registry:
                raise AgentLoopError(f"prompt {row.get('index', i)}: agent_name={name!r} names no agent loop (loops: "
                                     f"{sorted(self.registry)}). Fix: list it in {KEY}, or fix the row's agent_name")
            for _ in range(params.n):
                call.samples.append(_Sample(len(call.samples), {**row, "prompt_ids": list(prompt)}, name, call))
        call.results, call.left = [None] * len(call.samples), len(call.samples)
        return call

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int = 0,
                 rows: list[dict] | None = None, multi_modal_inputs: list | None = None, request_prefix: str = "custom",
                 tools_kwargs=None, interaction_kwargs=None, messages=None) -> AgentOutput:
        """`AgentLoop.generate`'s call; `tools_kwargs`, `interaction_kwargs` and `messages` (what `agent_kwargs` gives
        the tool loop) reach the loops inside `rows`, as verl's loops get them."""
        call = self.open(prompts, params, first_index=first_index, rows=rows, multi_modal_inputs=multi_modal_inputs,
                         request_prefix=request_prefix)
        scheduler = getattr(self.engine, "scheduler", None)
        interval = getattr(scheduler, "prefill_interval", None)
        if interval is not None:                # later turns arrive one by one: batch their prefills (as the tool
            scheduler.prefill_interval = PREFILL_INTERVAL          # loop does; a replica's followers get it too)
        loop = asyncio.new_event_loop()
        try:
            results = loop.run_until_complete(self._run(call.samples))
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())      # (the loops' run_in_executor threads)
            loop.close()
            if interval is not None:
                scheduler.prefill_interval = interval
        return self.output(call, results)

    # -- the event loop
    async def _run(self, samples: list[_Sample]) -> list:
        tasks = [asyncio.ensure_future(self._one(s)) for s in samples]
        finished: list = []                             # tasks as they finish (no scan of all tasks each step)
        for t in tasks:
            t.add_done_callback(finished.append)
        quiet, seen, checked = time.monotonic(), None, 0
        try:
            while True:
                await asyncio.sleep(0)                  # the loops run to their next wait
                for t in finished[checked:]:
                    if t.exception() is not None:       # (a loop's error: raised here, naming it)
                        t.result()
                done = checked = len(finished)
                if done == len(tasks):
                    return [t.result() for t in tasks]
                if (done, self._requests) != seen:     # a loop finished or asked for a turn: not stuck
                    quiet, seen = time.monotonic(), (done, self._requests)
                if self.engine.has_unfinished_requests():
                    self.engine.step()
                    quiet = time.monotonic()
                else:                                   # nothing to generate: the loops wait on their own work
                    await asyncio.sleep(IDLE_POLL_S)
                    if time.monotonic() - quiet > self.timeout_s:
                        stuck = [s.index for s, t in zip(samples, tasks) if not t.done()]
                        raise AgentLoopError(
                            f"custom agent loops: samples {stuck[:8]}{'...' if len(stuck) > 8 else ''} neither "
                            f"generated nor finished for {self.timeout_s:.0f} s (a tool or environment that does not "
                            "answer?). Fix: bound their waits, or raise actor_rollout_ref.rollout.multi_turn."
                            "tool_timeout (this limit is it + 60 s)")
                self.deliver(self.engine.pop_finished())
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                self._drain()
            except Exception:           # (an engine that failed itself: its own error is the one raised)
                pass
            raise

    def deliver(self, finished: list[tuple]) -> None:
        """The engine's finished requests (`pop_finished`) to the loops awaiting them (from the loops' own event
        loop's thread, or any other: each future is resolved in its loop)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for key, out in finished:
            future = self._waiting.pop(key, None)
            if future is None or future.done():
                continue
            if future.get_loop() is here:
                future.set_result(out)
            else:
                future.get_loop().call_soon_threadsafe(_resolve, future, out)

    def _drain(self) -> None:
        """After a failure: finish what the engine still runs (bounded by the requests' max_tokens), so that it is
        empty for the next call."""
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.pop_finished()
        self._waiting.clear()

    async def _one(self, s: _Sample):
        cls, kwargs = self.registry[s.name]
        params = s.call.params
        try:
            agent = cls(trainer_config=DictConfigWrap(ConfigView(self.cfg)), server_manager=ServerManager(self, s),
                        tokenizer=self.tokenizer, processor=None, dataset_cls=None,
                        data_config=DictConfigWrap(ConfigView(self.cfg.data)), hf_model_type=None,
                        tools=ToolListWrap(self.tools), **kwargs)
            sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                        "repetition_penalty": 1.0, "logprobs": True}
            if params.greedy:
                sampling.update(temperature=0.0, top_p=1.0, top_k=-1)
            return await agent.run(sampling, **s.row)
        except AgentLoopError:
            raise
        except Exception as e:
            raise AgentLoopError(f"agent loop {s.name!r} ({cls.__module__}.{cls.__qualname__}) failed on sample "
                                 f"{s.call.first + s.index} (prompt {s.row.get('index')}): {type(e).__name__}: "
                                 f"{e}") from e

    async def _generate(self, s: _Sample, prompt_ids: list[int], sampling: dict) -> TokenOutput:
        params = self._sampling(s, prompt_ids, sampling)
        key = (s.call.prefix, s.index, s.calls)
        s.calls += 1
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self._submit(key, prompt_ids, params, s.call.first + s.index)
        out: RolloutOutput = await future
        ids, logprobs = list(out.token_ids[0]), [float(x) for x in out.logprobs[0]]
        version = getattr(self.engine, "weight_version", 0)
        s.generated.append((ids, logprobs, per_token_versions(out.versions[0] if out.versions else None, len(ids),
                                                              version)))
        s.last_finish = out.finish_reasons[0]
        return TokenOutput(token_ids=ids, log_probs=logprobs,
                           stop_reason="length" if out.finish_reasons[0] == "length" else "completed",
                           num_preempted=int(out.metrics.get("rollout/num_preemptions", 0)))

    def _add_now(self, key, prompt_ids: list[int], params: SamplingParams, first_index: int) -> None:
        self.engine.add_request(key, [prompt_ids], params, first_index=first_index)
        self._requests += 1

    def _sampling(self, s: _Sample, prompt_ids: list[int], sampling: dict) -> SamplingParams:
        """verl's sampling dict as lathe's parameters; the run's seeding by sample and turn."""
        if not prompt_ids:
            raise AgentLoopError(f"agent loop {s.name!r}: generate got empty prompt_ids (sample "
                                 f"{s.call.first + s.index})")
        unknown = sorted(set(sampling) - SAMPLING_KEYS - IGNORED_SAMPLING_KEYS - {"repetition_penalty", "seed"})
        if unknown:
            raise AgentLoopError(f"agent loop {s.name!r}: sampling_params {unknown} are not implemented in lathe's "
                                 f"engine (it takes {sorted(SAMPLING_KEYS)}). Fix: remove them")
        if sampling.get("repetition_penalty", 1.0) != 1.0:
            raise AgentLoopError(f"agent loop {s.name!r}: repetition_penalty={sampling['repetition_penalty']} is not "
                                 "implemented in lathe's engine. Fix: leave it at 1.0")
        if sampling.get("n", 1) != 1:
            raise AgentLoopError(f"agent loop {s.name!r}: sampling_params n={sampling['n']}; a generate call samples "
                                 "one response (verl's too). Fix: call generate once per response")
        base_params = s.call.params
        budget = sampling.get("max_tokens", sampling.get("max_new_tokens", self.response_length))
        stop = sampling.get("stop") or []
        temperature = float(sampling.get("temperature", base_params.temperature))
        base = int(sampling["seed"]) if sampling.get("seed") is not None else s.call.base    # (a loop's own seed)
        seed = base if s.calls == 0 else sequence_seed(base, -s.calls)
        return replace(base_params, n=1, temperature=temperature, do_sample=temperature > 0,
                       top_p=float(sampling.get("top_p", base_params.top_p)),
                       top_k=int(sampling.get("top_k", base_params.top_k)),
                       max_tokens=max(0, min(int(budget), self.response_length)),
                       min_tokens=int(sampling.get("min_tokens", 0)),
                       ignore_eos=bool(sampling.get("ignore_eos", False)),
                       stop=[stop] if isinstance(stop, str) else list(stop),
                       stop_token_ids=sorted(set(base_params.stop_token_ids) | set(sampling.get("stop_token_ids")
                                                                                   or [])), seed=seed)

    # -- outputs
    def output(self, call: _Call, results: list) -> AgentOutput:
        """The call's samples as `AgentLoop.generate` returns them, each loop's output checked; per token, the
        weight version that sampled it (what the loop appended: the last model token's)."""
        samples = call.samples
        prompts, ids, logprobs, masks, finish, turns, scores, extras, gen_s, tool_s, versions = (
            [] for _ in range(11))
        current = getattr(self.engine, "weight_version", 0)
        for s, out in zip(samples, results):
            p, r, m, lp = self._checked(s, out)
            prompts.append(p)
            ids.append(r)
            masks.append(m)
            logprobs.append(lp)
            versions.append(version_spans(_aligned_versions(r, m, s.generated), current))
            finish.append("length" if len(r) >= self.response_length or s.last_finish == "length" else "stop")
            turns.append(int(out.num_turns or 0))
            scores.append(None if out.reward_score is None else float(out.reward_score))
            extras.append(dict(out.extra_fields or {}))
            timing = out.metrics if isinstance(out.metrics, AgentLoopMetrics) else AgentLoopMetrics(
                **{k: v for k, v in (out.metrics or {}).items() if k in AGENT_METRICS})
            gen_s.append(timing.generate_sequences)
            tool_s.append(timing.tool_calls)
        metrics = {"timing_s/agent_loop": time.perf_counter() - call.start, "agent/custom_loops": float(len(samples))}
        if samples:
            for name, values in (("generate_sequences", gen_s), ("tool_calls", tool_s)):
                metrics.update({f"timing_s/agent_loop/{name}/mean": sum(values) / len(values),
                                f"timing_s/agent_loop/{name}/max": max(values)})
        return AgentOutput(token_ids=ids, logprobs=logprobs, finish_reasons=finish, metrics=metrics,
                           versions=versions, loss_masks=masks, num_turns=turns,
                           tool_calls=[0] * len(samples), tool_errors=[0] * len(samples), tool_seconds=tool_s,
                           turn_scores=[list(e.get("turn_scores") or []) for e in extras],
                           tool_rewards=[{} for _ in samples], prompt_ids=prompts, reward_scores=scores,
                           extra_fields=extras)

    def _checked(self, s: _Sample, out) -> tuple[list[int], list[int], list[int], list[float]]:
        where = f"agent loop {s.name!r}, sample {s.call.first + s.index} (prompt {s.row.get('index')})"
        if not all(hasattr(out, k) for k in ("prompt_ids", "response_ids", "response_mask")):
            raise AgentLoopError(f"{where}: run returned {type(out).__name__}, not an AgentLoopOutput. Fix: return "
                                 "AgentLoopOutput(prompt_ids=..., response_ids=..., response_mask=..., ...)")
        prompt, response, mask = list(out.prompt_ids), list(out.response_ids), list(out.response_mask)
        if out.multi_modal_data:
            raise AgentLoopError(f"{where}: " + _unsupported("multi_modal_data"))
        if out.routed_experts is not None:
            raise AgentLoopError(f"{where}: routed_experts (routing replay) from a custom agent loop is not "
                                 "implemented yet in lathe. Fix: leave it None")
        if not prompt:
            raise AgentLoopError(f"{where}: empty prompt_ids. Fix: return the prompt the loop generated from")
        if len(prompt) > self.prompt_length:
            raise AgentLoopError(f"{where}: {len(prompt)} prompt tokens, over data.max_prompt_length="
                                 f"{self.prompt_length}. Fix: cut them in the loop (prompt_ids[-prompt_length:]) "
                                 "or raise data.max_prompt_length")
        if len(mask) != len(response) or set(mask) - {0, 1}:
            raise AgentLoopError(f"{where}: response_mask has {len(mask)} values for {len(response)} response "
                                 "tokens. Fix: one 0/1 per response token (1 on the model's)")
        if len(response) > self.response_length:
            raise AgentLoopError(f"{where}: {len(response)} response tokens, over data.max_response_length="
                                 f"{self.response_length}. Fix: cut them in the loop (response_ids[:response_length], "
                                 "and the mask and log-probs alike)")
        logprobs = out.response_logprobs
        if logprobs is None:
            logprobs = _aligned_logprobs(response, mask, s.generated)
            if logprobs is None:
                raise AgentLoopError(f"{where}: no response_logprobs, and its model tokens (mask 1) are not its "
                                     "generate calls' tokens in order, so they cannot be taken from there. Fix: "
                                     "return response_logprobs (TokenOutput.log_probs on the model's tokens, 0.0 "
                                     "elsewhere)")
        elif len(logprobs) != len(response):
            raise AgentLoopError(f"{where}: {len(logprobs)} response_logprobs for {len(response)} response tokens. "
                                 "Fix: one per response token (0.0 where the mask is 0)")
        return prompt, response, mask, [float(x) for x in logprobs]


def _aligned(response: list[int], mask: list[int], generated: list, field_: int, other) -> list | None:
    """Per response token, field `field_` of the generate calls' records (`_Sample.generated`: 1 the log-probs, 2 the
    versions) on the model's tokens (mask 1), when those are the calls' tokens in order (a prefix of them: the loop
    may cut the last); `other(previous value)` on the rest. None when they are not."""
    tokens = [t for record in generated for t in record[0]]
    values = [v for record in generated for v in record[field_]]
    out, k = [], 0
    for token, m in zip(response, mask):
        if not m:
            out.append(other(out[-1] if out else None))
            continue
        if k >= len(tokens) or tokens[k] != token:
            return None
        out.append(values[k])
        k += 1
    return out


def _aligned_logprobs(response: list[int], mask: list[int], generated: list) -> list[float] | None:
    """The log-probs of the response's model tokens from the generate calls (0.0 on the rest), or None."""
    return _aligned(response, mask, generated, 1, lambda previous: 0.0)


def _aligned_versions(response: list[int], mask: list[int], generated: list) -> list[int]:
    """Per response token, the weight version that sampled it (an appended token: the one before it's); when the
    model's tokens are not the calls' in order, every token the oldest version any call used (the staleness bound
    then holds for the whole trajectory)."""
    oldest = min((v for record in generated for v in record[2]), default=None)
    out = _aligned(response, mask, generated, 2, lambda previous: oldest if previous is None else previous)
    if out is None or (out and out[0] is None):
        return [oldest] * len(response) if oldest is not None else []
    return out


def _resolve(future: asyncio.Future, out) -> None:
    if not future.done():
        future.set_result(out)


class CustomStream:
    """Custom agent loops on an engine that a fully-async replica's thread steps without end (`AgentStream`'s
    interface, driven by `lathe.workers.fully_async`). The loops run as coroutines of an event loop in a thread of
    their own; a loop's `generate` call is queued for the engine's thread, which adds it to the engine at its next
    `advance` (on a tensor-parallel replica through its lockstep, as the tool loop's turns), and `on_finished` hands
    the engine's finished requests back to the loops awaiting them. A request's output is ready once every one of its
    samples' loops has returned; each token keeps the weight version that sampled it (a sync that interrupts a turn
    leaves it continuing under the new weights). `on_answer` wakes the engine's thread: a turn queued, a request
    done, a loop failed (its error is raised in that thread by the next `advance` or `on_finished`)."""

    def __init__(self, runner: CustomAgentLoops, on_answer):
        self.runner, self.on_answer = runner, on_answer
        self._lock = threading.Lock()
        self._adds: list[tuple] = []
        self._done: list[tuple] = []
        self._error: BaseException | None = None
        self._live = 0                                  # requests not done
        self._futures: set = set()
        self._progress = time.monotonic()               # the last turn queued or answered, or loop returned
        self._closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lathe-agent-loops", daemon=True)
        self._thread.start()
        self.loop.call_soon_threadsafe(self._watch)
        runner._submit = self._queue
        scheduler = getattr(runner.engine, "scheduler", None)
        if scheduler is not None:                       # later turns arrive one by one: batch their prefills
            scheduler.prefill_interval = PREFILL_INTERVAL

    def add(self, request_id, prompts: list[list[int]], params: SamplingParams, *, first_index: int,
            agent: dict | None = None, multi_modal_inputs: list[dict | None] | None = None) -> None:
        """Start a request's loops (`agent`: `rows`, the prompts' dataset fields, as `agent_kwargs` gives them;
        `multi_modal_inputs`: the request's images, as `AgentStream.add` takes them, else the rows')."""
        if multi_modal_inputs is None:
            multi_modal_inputs = (agent or {}).get("multi_modal_inputs")
        call = self.runner.open(prompts, params, first_index=first_index, rows=(agent or {}).get("rows"),
                                multi_modal_inputs=multi_modal_inputs, request_prefix="stream")
        call.request_id = request_id
        with self._lock:
            self._live += 1
        if not call.samples:
            self._finish(call)
        for s in call.samples:
            future = asyncio.run_coroutine_threadsafe(self.runner._one(s), self.loop)
            with self._lock:
                self._futures.add(future)
            future.add_done_callback(lambda f, s=s: self._sample_done(s, f))

    def _queue(self, key, prompt_ids: list[int], params: SamplingParams, first_index: int) -> None:
        """(The loops' thread.) A loop's turn, for the engine's thread to add."""
        with self._lock:
            self._adds.append((key, prompt_ids, params, first_index))
            self._progress = time.monotonic()
        self.on_answer()

    def _watch(self) -> None:
        """(The loops' thread, every second.) Loops that are not done, none of them waiting for the engine, and
        nothing queued, answered or returned for `timeout_s`: stuck (a tool or environment that never answers), an
        error for the engine's thread."""
        if self._closed:
            return
        with self._lock:
            stuck = (self._live and not self._adds and not self.runner._waiting
                     and time.monotonic() - self._progress > self.runner.timeout_s)
            if stuck and self._error is None:
                self._error = AgentLoopError(
                    f"custom agent loops: {self._live} request(s) neither generated nor finished for "
                    f"{self.runner.timeout_s:.0f} s (a tool or environment that does not answer?). Fix: bound their "
                    "waits, or raise actor_rollout_ref.rollout.multi_turn.tool_timeout (this limit is it + 60 s)")
        if stuck:
            self.on_answer()
        self.loop.call_later(1.0, self._watch)

    def _sample_done(self, s: _Sample, future) -> None:
        with self._lock:
            self._futures.discard(future)
        self._progress = time.monotonic()
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            call = s.call
            call.results[s.index] = future.result()
            call.left -= 1                              # (each sample's callback once, in the loops' thread)
            if call.left:
                return
            try:
                self._finish(call)
                return
            except BaseException as e:                  # noqa: BLE001 - a malformed output: raised in the engine's
                error = e                               # thread
        with self._lock:
            self._error = self._error or error
        self.on_answer()

    def _finish(self, call: _Call) -> None:
        output = self.runner.output(call, call.results)
        with self._lock:
            self._done.append((call.request_id, output))
            self._live -= 1
        self.on_answer()

    def on_finished(self, finished: list[tuple]) -> list[tuple]:
        """The engine's finished turns (`pop_finished`) to their loops; the requests done so far."""
        if finished:
            self._progress = time.monotonic()
        self.runner.deliver(finished)
        return self._take()

    def advance(self) -> list[tuple]:
        """The loops' queued turns into the engine; the requests done so far."""
        with self._lock:
            adds, self._adds = self._adds, []
        for key, prompt_ids, params, first_index in adds:
            self.runner.engine.add_request(key, [prompt_ids], params, first_index=first_index)
            self.runner._requests += 1
        return self._take()

    def _take(self) -> list[tuple]:
        with self._lock:
            if self._error is not None:
                raise self._error
            out, self._done = self._done, []
        return out

    def ready(self) -> bool:
        """Turns to add, requests done, or a loop's error to raise (`advance` has work)."""
        with self._lock:
            return bool(self._adds or self._done or self._error is not None)

    def busy(self) -> bool:
        """A request is not done."""
        with self._lock:
            return self._live > 0

    def close(self) -> None:
        self._closed = True
        with self._lock:
            running = list(self._futures)
        for future in running:
            future.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def agent_stream(loop, on_answer):
    """The fully-async replica's multi-turn stream over `loop`: custom agent loops' (`CustomStream`) or the tool
    loop's (`lathe.rollout.agent.stream.AgentStream`)."""
    if isinstance(loop, CustomAgentLoops):
        return CustomStream(loop, on_answer)
    from lathe.rollout.agent.stream import AgentStream
    return AgentStream(loop, on_answer)


def build_custom_loops(cfg, engine, tokenizer, tools=None) -> CustomAgentLoops:
    """The run's custom agent loops over `engine` (`agent_loop_config_path`, `default_agent_loop`)."""
    agent = cfg.actor_rollout_ref.rollout.agent or {}
    return CustomAgentLoops(engine, tokenizer, cfg, registry=load_registry(agent.get("agent_loop_config_path")),
                            default=agent.get("default_agent_loop") or BUILTIN,
                            response_length=cfg.data.max_response_length, prompt_length=cfg.data.max_prompt_length,
                            timeout_s=cfg.actor_rollout_ref.rollout.multi_turn.tool_timeout + 60.0, tools=tools)


def custom_loops_in(rollout_cfg) -> bool:
    """Whether rollouts (`actor_rollout_ref.rollout`) go through custom agent loops: an agent_loop_config_path is
    set."""
    return bool((rollout_cfg.agent or {}).get("agent_loop_config_path"))
