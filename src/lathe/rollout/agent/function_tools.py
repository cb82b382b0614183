"""Tools from a Python file of `@function_tool` functions (verl's `rollout.multi_turn.function_tool_path`).

    from lathe.rollout.agent.function_tools import function_tool

    @function_tool
    def lookup(item: int) -> str:
        '''Look an item up.

        Args:
            item: the item's number
        '''
        return SECRETS[item]

The tool's OpenAI schema comes from the function (`transformers.utils.get_json_schema`: a Google-style docstring
with an ``Args:`` block and a type hint on every parameter), or from ``schema=`` given whole; ``@function_tool("name")``
renames it. The model's arguments are the function's keyword arguments; it may be ``async def``. What it returns is
the answer the model reads: a str, a `ToolResponse`, a dict (as JSON), ``(answer,)``, ``(answer, reward)`` or
``(answer, reward, metrics)``, anything else as ``str()`` (verl's rules). A file of verl's (``from
verl.tools.function_tool import function_tool``) ports by importing the decorator from here instead.

`load_function_tools` runs the file once (a module of its own) and returns the tools its decorators registered;
every problem is a `ToolConfigError` naming the file, the function and the fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import zlib
from pathlib import Path
from typing import Any, Callable

from lathe.rollout.agent.tools import BaseTool, ToolConfigError, ToolResponse

__all__ = ["FunctionTool", "function_tool", "load_function_tools"]

KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"
_registered: list[FunctionTool] = []       # what the decorators of the file being loaded registered
_loaded: dict[Path, list[FunctionTool]] = {}


class FunctionTool(BaseTool):
    """A tool whose call is `fn(**arguments)`; stateless (no per-trajectory instance)."""

    def __init__(self, fn: Callable, tool_schema: dict):
        super().__init__(tool_schema=tool_schema)
        self.fn = fn

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[Any, float, dict]:
        out = self.fn(**parameters)
        if inspect.isawaitable(out):
            out = await out
        return answer(out)


def answer(out: Any) -> tuple[Any, float, dict]:
    """A function tool's return value as (answer, step reward, metrics) (the module doc's rules)."""
    if isinstance(out, tuple):
        if not 1 <= len(out) <= 3:
            raise TypeError(f"a function tool returned a tuple of {len(out)}; return (answer,), (answer, reward) or "
                            f"(answer, reward, metrics)")
        reward = 0.0 if len(out) < 2 or out[1] is None else float(out[1])
        metrics = {} if len(out) < 3 or out[2] is None else dict(out[2])
        return _text(out[0]), reward, metrics
    return _text(out), 0.0, {}


def _text(value: Any) -> Any:
    if isinstance(value, (ToolResponse, str)) or hasattr(value, "text"):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Register a function as a tool: ``@function_tool``, ``@function_tool("name")`` or ``@function_tool(schema=
    {...})`` (the module doc). The function itself is returned unchanged."""
    def register(fn: Callable, tool_name: str | None) -> Callable:
        tool_name = tool_name or fn.__name__
        spec = _schema(fn, tool_name) if schema is None else schema
        try:
            _registered.append(FunctionTool(fn, spec))
        except ValueError as e:
            raise ToolConfigError(f"@function_tool {tool_name} ({_where(fn)}): {e}") from None
        return fn

    if callable(name):
        return register(name, None)
    return lambda fn: register(fn, name)


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


def _schema(fn: Callable, tool_name: str) -> dict:
    """The OpenAI function schema transformers infers from `fn`'s docstring and type hints."""
    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ToolConfigError(f"@function_tool {tool_name} ({_where(fn)}): parameters {variadic} (*args/**kwargs) "
                              f"have no place in a tool schema; name each parameter")
    from transformers.utils import get_json_schema
    try:
        out = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
        raise ToolConfigError(f"@function_tool {tool_name} ({_where(fn)}): its schema cannot be inferred: {e}. Fix: "
                              f"give it a docstring with a summary and an 'Args:' line per parameter, and a type "
                              f"hint on each parameter, or pass schema={{...}} to the decorator") from None
    out["function"]["name"] = tool_name
    out["function"].pop("return", None)
    return out


def load_function_tools(path: str | Path, *, key: str = KEY) -> list[FunctionTool]:
    """The tools that the `@function_tool` decorators of the Python file at `path` register (the file runs once);
    `key`: the setting that names the file, in errors."""
    file = Path(path).expanduser().resolve()
    if file in _loaded:
        return _loaded[file]
    if not file.is_file():
        raise ToolConfigError(f"{key}={path}: no such file. Fix: point it at a Python file of @function_tool "
                              f"functions, or remove it")
    module_name = f"lathe_function_tools_{file.stem}_{zlib.crc32(str(file).encode()):08x}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    start = len(_registered)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ToolConfigError:
        raise
    except ModuleNotFoundError as e:
        hint = (" Fix: import the decorator from lathe: from lathe.rollout.agent.function_tools import function_tool"
                if (e.name or "").split(".")[0] == "verl" else f" Fix: install the package that provides {e.name!r}")
        raise ToolConfigError(f"{key}={path}: importing it failed: {e}.{hint}") from None
    except Exception as e:  # noqa: BLE001 - a broken user file is a config error
        raise ToolConfigError(f"{key}={path}: running it failed: {type(e).__name__}: {e}") from e
    finally:
        found = _registered[start:]
        del _registered[start:]
    if not found:
        sys.modules.pop(module_name, None)
        raise ToolConfigError(f"{key}={path}: the file registers no tools. Fix: decorate each tool function with "
                              f"@function_tool (from lathe.rollout.agent.function_tools import function_tool)")
    names = [tool.name for tool in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolConfigError(f"{key}={path}: two functions register the tool name(s) {twice}. Fix: give each its "
                              f"own, @function_tool(\"other_name\")")
    _loaded[file] = found
    return found
