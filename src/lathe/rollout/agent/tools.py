"""Tools in verl's shape, and the driver that runs them for many trajectories at once.

A tool is a `BaseTool` subclass (verl's interface: a verl tool ports by importing `BaseTool` and `ToolResponse`
from here). Its methods may be ``async def`` (as in verl) or plain ``def``; ``execute`` may return a str, a
`ToolResponse`, a dict with "text", or verl's ``(response, step_reward, metrics)``. ``tool_schema`` is the OpenAI
function-schema dict ``{"type": "function", "function": {"name", "description", "parameters"}}``.

`ToolSet.open` gives a trajectory its `ToolSession`: it creates the trajectory's instance of a tool on its first
call (verl's ``create_kwargs`` from the row's ``extra_info["tools_kwargs"][tool_name]``), runs calls with a timeout
and turns every failure into an answer for the model (``ToolResult.error``). Each tool-method call runs in a fresh
daemon thread with its own event loop (closed afterwards: keep no loop-bound objects, an aiohttp session say,
between calls). On a timeout the model is answered at once, but a thread cannot be stopped: the tool's work runs on
until it returns (the code interpreter's sandbox has its own wall-clock limit).

`lathe.rollout.agent.tool_config.load_tools` reads verl's tool-config YAML
(``actor_rollout_ref.rollout.multi_turn.tool_config_path``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4


from lathe.rollout.agent.parser import ToolCall

__all__ = ["BaseTool", "ToolConfigError", "ToolImageError", "ToolResponse", "ToolResult", "ToolSession", "ToolSet",
           "ToolTimeout", "check_schema", "run_with_timeout"]

logger = logging.getLogger(__name__)

SCHEMA_HELP = "tool_schema: {type: function, function: {name: ..., description: ..., parameters: {type: object, ...}}}"


class ToolConfigError(ValueError):
    """A tool config (or a tool's construction) is wrong; the message names the file, the entry and the fix."""


class ToolTimeout(TimeoutError):
    """A tool method did not return within its time limit."""


class ToolImageError(NotImplementedError):
    """A tool answered with an image or a video (verl's `ToolResponse.image` / `.video`): tool answers are text in
    lathe's agent loop, and a picture the model would never see is not dropped silently. It stops the run."""


@dataclass
class ToolResponse:
    text: str | None = None
    image: Any = None                 # verl's multimodal fields: accepted so verl tools port; an answer that fills one
    video: Any = None                 # stops the run (ToolImageError): tool answers are text only


@dataclass
class ToolResult:
    """One call's outcome, as the agent loop uses it."""

    text: str                         # the tool's answer, or the error message, for the model to read
    reward: float = 0.0               # the step reward `execute` returned
    error: bool = False               # unknown tool, bad arguments, tool exception or timeout
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)


def check_schema(schema: Any) -> dict:
    """`schema` as an OpenAI function-schema dict (a pydantic model is dumped); ValueError says what is wrong."""
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_none=True)
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
        raise ValueError(  # noqa: TRY004 - a config value, reported as ToolConfigError
            f"tool_schema must be a mapping with a 'function' mapping; write {SCHEMA_HELP}")
    name = schema["function"].get("name")
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise ValueError(f"tool_schema.function.name={name!r} must be a non-empty name without spaces; "
                         f"write {SCHEMA_HELP}")
    if schema.get("type", "function") != "function":
        raise ValueError(f"tool_schema.type={schema['type']!r}: only 'function' tools exist; write {SCHEMA_HELP}")
    parameters = schema["function"].get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError("tool_schema.function.parameters must be a JSON-schema mapping (type: object, properties)")
    return {"type": "function", **copy.deepcopy(schema)}


class BaseTool:
    """verl's tool interface. Override `execute` (and `create`/`calc_reward`/`release` for per-trajectory state);
    `default_schema` lets a tool config omit ``tool_schema``."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.default_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool_schema; pass {SCHEMA_HELP}")
        self.tool_schema = check_schema(schema)

    @classmethod
    def default_schema(cls) -> dict | None:
        """The schema used when the tool config gives none (None: the config must give one)."""
        return None

    @property
    def name(self) -> str:
        return self.__dict__.get("_name") or self.tool_schema["function"]["name"]

    @name.setter
    def name(self, value: str) -> None:          # verl's BaseTool assigns self.name; keep subclasses that do working
        self._name = value

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start one trajectory's instance; kwargs are its ``create_kwargs``."""
        return instance_id or uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call: (answer, step reward, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} does not define execute(instance_id, parameters)")

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The instance's reward once the trajectory ends."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Drop the instance's state."""


_thread_state = threading.local()


def _settle(value: Any) -> Any:
    """`value`, awaited on this thread's private event loop (closed when `run_with_timeout`'s thread ends)."""
    if not inspect.isawaitable(value):
        return value
    if getattr(_thread_state, "loop", None) is None:
        _thread_state.loop = asyncio.new_event_loop()

    async def wait() -> Any:
        return await value
    return _thread_state.loop.run_until_complete(wait())


def run_with_timeout(fn: Callable[[], Any], timeout_s: float | None, name: str = "tool") -> Any:
    """``fn()`` (awaited when it returns an awaitable) in a new daemon thread: its result, or what it raised, or
    `ToolTimeout` after `timeout_s` seconds (the thread then runs on until `fn` returns; it cannot be stopped)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(_settle(fn()))
        except Exception as e:                  # noqa: BLE001 - handed to the caller
            future.set_exception(e)
        except BaseException as e:              # noqa: BLE001 - a tool's sys.exit() must not leave the caller waiting
            future.set_exception(RuntimeError(f"the tool raised {type(e).__name__}: {e}"))
        finally:
            if getattr(_thread_state, "loop", None) is not None:
                _thread_state.loop.close()

    threading.Thread(target=work, name=f"lathe-tool-{name}", daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        raise ToolTimeout(f"{name} timed out after {timeout_s:g} s")
    return future.result()


class _BadReturn(RuntimeError):
    """A tool's execute returned something that is not an answer."""


def _normalize(out: Any) -> tuple[str, float, dict]:
    """An `execute` result (str, ToolResponse, {"text": ...} or verl's 3-tuple) as (text, reward, metrics)."""
    reward, metrics = 0.0, {}
    if isinstance(out, tuple) and len(out) == 3:
        out, reward, metrics = out
    media = [k for k in ("image", "video") if (out.get(k) if isinstance(out, dict) else getattr(out, k, None))]
    if media:
        raise ToolImageError(f"it returned {' and '.join(media)} content (verl's ToolResponse.{media[0]}), which "
                             "lathe's agent loop does not show the model (tool answers are text only). Fix: answer "
                             "with text (ToolResponse(text=...)), or describe the picture in words")
    if isinstance(out, dict) and "text" in out:
        text = out["text"]
    elif isinstance(out, str) or out is None:
        text = out
    elif hasattr(out, "text"):                  # a ToolResponse (lathe's, or verl's own)
        text = out.text
    else:
        raise _BadReturn(f"execute returned {type(out).__name__}; return a str, a ToolResponse, a dict with "
                         f"'text', or (response, reward, metrics)")
    try:
        reward = 0.0 if reward is None else float(reward)
    except (TypeError, ValueError):
        raise _BadReturn(f"execute returned the step reward {reward!r}, not a number") from None
    return ("" if text is None else str(text)), reward, (dict(metrics) if isinstance(metrics, dict) else {})


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0                              # verl's sandbox tool returns a list; count it as no reward


def _describe(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"missing key {e}"
    return (str(e) or type(e).__name__)[:500]


def _parameters_hint(tool: Any) -> str:
    """'its parameters: a (required), b' from the tool's schema, for error messages."""
    params = (getattr(tool, "tool_schema", None) or {}).get("function", {}).get("parameters") or {}
    required = set(params.get("required") or [])
    names = [k + (" (required)" if k in required else "") for k in params.get("properties") or {}]
    return "its parameters: " + ", ".join(names) if names else "it takes no documented parameters"


def _kwargs_ok(entry: Any) -> bool:
    """One tool's entry of tools_kwargs: None or {create_kwargs: {...}, execute_kwargs: {...}, ...}."""
    return entry is None or isinstance(entry, dict) and all(v is None or isinstance(v, dict) for v in entry.values())


def _accepts(fn: Callable, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class ToolSession:
    """One trajectory's tool instances (opened lazily, one per tool). Thread-safe; `call` never raises."""

    def __init__(self, tools: dict[str, Any], trajectory_id: str, tools_kwargs: dict, *, release_timeout_s: float):
        self.trajectory_id = trajectory_id
        self.release_timeout_s = release_timeout_s
        self._tools, self._kwargs = tools, tools_kwargs
        self._instances: dict[str, Any] = {}
        self._locks = {name: threading.Lock() for name in tools}
        self._closed = False

    def _kw(self, name: str, key: str) -> dict:
        """verl's per-tool kwargs of this trajectory: ``tools_kwargs[name][key]`` (create_kwargs, execute_kwargs,
        calc_reward_kwargs, release_kwargs)."""
        value = (self._kwargs.get(name) or {}).get(key)
        return dict(value) if value else {}

    def _instance(self, name: str) -> Any:
        """The trajectory's instance id of tool `name`, created on first use (runs in a tool thread)."""
        with self._locks[name]:
            if name in self._instances:
                return self._instances[name]
            tool, kwargs = self._tools[name], self._kw(name, "create_kwargs")
            if "create_kwargs" not in kwargs and _accepts(tool.create, "create_kwargs"):
                kwargs["create_kwargs"] = self._kw(name, "create_kwargs")   # verl's agent loop passes them so
            created = _settle(tool.create(self.trajectory_id, **kwargs))
            instance = created[0] if isinstance(created, tuple) else created
            self._instances[name] = self.trajectory_id if instance is None else instance
            return self._instances[name]

    def _execute(self, name: str, arguments: dict) -> Any:
        instance = self._instance(name)
        return _settle(self._tools[name].execute(instance, arguments, **self._kw(name, "execute_kwargs")))

    def call(self, call: ToolCall, *, timeout_s: float) -> ToolResult:
        """Run one parsed call (creating the tool's instance first if needed) within `timeout_s` seconds."""
        start = time.monotonic()
        name, arguments = getattr(call, "name", None), getattr(call, "arguments", None)
        if not isinstance(name, str) or name not in self._tools:
            known = ", ".join(sorted(self._tools)) or "(none)"
            return self._error(start, f"there is no tool named {name!r}; the tools are: {known}")
        if self._closed:
            return self._error(start, f"the tools of trajectory {self.trajectory_id} are closed")
        if not isinstance(arguments, dict):
            hint = _parameters_hint(self._tools[name])
            return self._error(start, f"{name}: the arguments must be a JSON object; {hint}")
        try:
            out = run_with_timeout(lambda: self._execute(name, dict(arguments)), timeout_s, name)
            text, reward, metrics = _normalize(out)
        except ToolTimeout:
            return self._error(start, f"{name} timed out after {timeout_s:g} s and gave no answer")
        except ToolImageError as e:
            raise ToolImageError(f"tool {name!r} (trajectory {self.trajectory_id}): {e}") from None
        except (TypeError, ValueError, KeyError) as e:
            args = json.dumps(arguments, ensure_ascii=False, default=str)[:300]
            return self._error(start, f"{name} error: {_describe(e)}. Called with {args}; "
                                      f"{_parameters_hint(self._tools[name])}")
        except Exception as e:  # noqa: BLE001 - any tool failure is an answer for the model
            logger.warning("tool %s failed for trajectory %s: %r", name, self.trajectory_id, e)
            return self._error(start, f"{name} failed: {type(e).__name__}: {_describe(e)}")
        return ToolResult(text, reward, False, time.monotonic() - start, metrics)

    @staticmethod
    def _error(start: float, text: str) -> ToolResult:
        return ToolResult(text=text, error=True, seconds=time.monotonic() - start)

    def rewards(self) -> dict[str, float]:
        """`calc_reward` of each tool this trajectory opened (0.0 where it fails or times out)."""
        out = {}
        for name, instance in list(self._instances.items()):
            tool, kwargs = self._tools[name], self._kw(name, "calc_reward_kwargs")
            try:
                out[name] = _as_float(run_with_timeout(lambda t=tool, i=instance, k=kwargs: t.calc_reward(i, **k),
                                                       self.release_timeout_s, name))
            except Exception as e:  # noqa: BLE001 - logged; the trajectory's other rewards still count
                logger.warning("calc_reward of tool %s failed for trajectory %s: %r", name, self.trajectory_id, e)
                out[name] = 0.0
        return out

    def close(self) -> None:
        """Release every instance; never raises (failures are logged). Later calls answer with an error."""
        self._closed = True
        instances, self._instances = self._instances, {}
        for name, instance in instances.items():
            tool, kwargs = self._tools[name], self._kw(name, "release_kwargs")
            try:
                run_with_timeout(lambda t=tool, i=instance, k=kwargs: t.release(i, **k), self.release_timeout_s, name)
            except Exception as e:  # noqa: BLE001 - close never raises
                logger.warning("release of tool %s failed for trajectory %s: %r", name, self.trajectory_id, e)


class ToolSet:
    """The tools of a run by name; opens one instance per (trajectory, tool) lazily."""

    def __init__(self, tools: Iterable[BaseTool] | dict[str, BaseTool] = (), *, release_timeout_s: float = 30.0):
        self.tools: dict[str, BaseTool] = {}
        self.release_timeout_s = release_timeout_s      # limit of calc_reward and release calls
        for tool in (tools.values() if isinstance(tools, dict) else tools):
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; give each its own tool_schema.function.name")
            self.tools[tool.name] = tool

    def schemas(self) -> list[dict]:
        """The tools' OpenAI schemas, for ``tokenizer.apply_chat_template(tools=...)``."""
        return [copy.deepcopy(tool.tool_schema) for tool in self.tools.values()]

    def open(self, trajectory_id: str, tools_kwargs: dict | None = None) -> ToolSession:
        """Trajectory `trajectory_id`'s session; `tools_kwargs` is its data row's ``extra_info["tools_kwargs"]``."""
        kwargs = tools_kwargs or {}
        if not isinstance(kwargs, dict) or not all(_kwargs_ok(kwargs.get(name)) for name in self.tools):
            raise TypeError(f"extra_info.tools_kwargs of trajectory {trajectory_id} is {kwargs!r:.300}; write "
                            f"{{tool_name: {{create_kwargs: {{...}}}}}} (verl's layout)")
        return ToolSession(self.tools, trajectory_id, kwargs, release_timeout_s=self.release_timeout_s)

    def __len__(self) -> int:
        return len(self.tools)
