"""Loading verl's tool-config YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``): ``tools:`` entries of
class_name, config and tool_schema, each built into a tool (lathe's built-ins, verl's names for them, or a class of
the user's) and checked, every problem a `ToolConfigError` naming the file and the entry. ``builtin:<name>`` names a
tool config that ships with lathe (`BUILTIN_TOOL_CONFIGS`) instead of a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lathe.rollout.agent.builtin_tools import resolve_tool_class
from lathe.rollout.agent.tools import SCHEMA_HELP, BaseTool, ToolConfigError, ToolSet, _describe, check_schema

# `tool_config_path` values that name a tool config shipped with lathe instead of a file (verl's `tools:` entries)
BUILTIN_TOOL_CONFIGS: dict[str, list[dict]] = {
    "builtin:secret_lookup": [{"class_name": "lathe.rollout.agent.builtin_tools.SecretLookupTool",
                               "config": {"type": "native"}}],
}


def load_tools(path: str | Path) -> ToolSet:
    """The tools of verl's tool-config YAML at `path` (``tools:`` entries of class_name, config, tool_schema), or of
    a built-in tool config (`BUILTIN_TOOL_CONFIGS`: ``builtin:<name>``)."""
    file, entries = Path(path), _builtin_entries(str(path))
    if entries is None:
        entries = _file_entries(file)
    tools, seen = [], {}
    for index, entry in enumerate(entries):
        tool = _load_entry(file, index, entry)
        if tool.name in seen:
            raise ToolConfigError(f"{file}: tools[{index}] ({tool.name}): the name is already used by "
                                  f"tools[{seen[tool.name]}]; give each tool its own tool_schema.function.name")
        seen[tool.name] = index
        tools.append(tool)
    return ToolSet(tools)


def _builtin_entries(name: str) -> list[dict] | None:
    """The entries of a built-in tool config; None when `name` is not ``builtin:...`` (a file path)."""
    if not name.startswith("builtin:"):
        return None
    if name not in BUILTIN_TOOL_CONFIGS:
        raise ToolConfigError(f"tool_config_path={name}: no such built-in tool config; built-in: "
                              f"{', '.join(BUILTIN_TOOL_CONFIGS)}, or give a tool YAML file")
    return BUILTIN_TOOL_CONFIGS[name]


def _file_entries(file: Path) -> list:
    """The ``tools:`` entries of a tool YAML file."""
    if not file.is_file():
        raise ToolConfigError(f"{file}: no such tool config file; fix actor_rollout_ref.rollout.multi_turn."
                              f"tool_config_path")
    if file.suffix == ".py":
        raise ToolConfigError(f"{file}: a Python file where a tool YAML is read (tool_config_path). Fix: name a file "
                              f"of @function_tool functions in multi_turn.function_tool_path (lathe generate: "
                              f"function_tool_path), and a tool YAML (tools: [{{class_name, config, tool_schema}}]) "
                              f"here")
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"{file}: not a readable YAML file: {e}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{file}: needs a top-level 'tools:' list of entries (class_name, config, "
                              f"tool_schema), as verl's tool configs have")
    return entries


def _load_entry(file: Path, index: int, entry: Any) -> BaseTool:
    """Build the tool of entry `index`; every problem is a ToolConfigError naming the file and entry."""
    schema = entry.get("tool_schema") if isinstance(entry, dict) else None
    name = (schema.get("function") or {}).get("name") if isinstance(schema, dict) else None
    where = f"{file}: tools[{index}]" + (f" ({name})" if isinstance(name, str) else "")
    try:
        cls, config = _entry_class(entry), entry.get("config") or {}
        schema = check_schema(schema if schema is not None else _default_schema(cls))
    except (TypeError, ValueError) as e:
        raise ToolConfigError(f"{where}: {e}") from None
    try:
        tool = cls(config=dict(config), tool_schema=schema)
    except ToolConfigError as e:
        raise ToolConfigError(f"{where}: {e}") from None
    except Exception as e:
        raise ToolConfigError(f"{where}: {cls.__name__}(config, tool_schema) failed: {type(e).__name__}: "
                              f"{_describe(e)}") from e
    if not isinstance(getattr(tool, "name", None), str):
        raise ToolConfigError(f"{where}: {cls.__name__} objects have no name; derive the class from "
                              f"lathe.rollout.agent.tools.BaseTool")
    return tool


def _entry_class(entry: Any) -> type:
    """The tool class of a config entry, after checking its class_name and config.type."""
    if not isinstance(entry, dict):
        raise TypeError(f"the entry is a {type(entry).__name__}; write a mapping of class_name, config, tool_schema")
    class_name, config = entry.get("class_name"), entry.get("config") or {}
    if not isinstance(class_name, str) or not class_name.strip():
        raise ValueError("class_name is missing; set it to a tool class, e.g. "
                         "lathe.rollout.agent.builtin_tools.CalculatorTool or your_module.YourTool")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a mapping (type: native, ...), not {type(config).__name__}")
    kind = config.get("type", "native")
    if kind != "native":
        raise ValueError("config.type=mcp: MCP tools are not implemented in lathe; wrap the service in a native "
                         "tool class (config.type: native)" if kind == "mcp" else
                         f"config.type={kind!r} is not known; use native")
    cls = resolve_tool_class(class_name.strip())
    if not isinstance(cls, type) or not callable(getattr(cls, "execute", None)) or (
            issubclass(cls, BaseTool) and cls.execute is BaseTool.execute):
        raise TypeError(f"{class_name} is not a tool class: it needs an execute(instance_id, parameters) method; "
                        f"derive it from lathe.rollout.agent.tools.BaseTool")
    return cls


def _default_schema(cls: type) -> dict:
    schema = cls.default_schema() if callable(getattr(cls, "default_schema", None)) else None
    if schema is None:
        raise ValueError(f"tool_schema is missing; add {SCHEMA_HELP}")
    return schema
