"""``${trainer.project_name}``-style references inside config values, resolved after all overrides.

A value that is exactly one reference takes the referenced value with its type (then it is checked
against the field's type); a reference inside a longer string is replaced by its text. verl's
``${oc.env:NAME,default}`` and ``${oc.select:path,default}`` are understood too, and OmegaConf's relative
references (``${.save_contents}``: a key of the same group).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from .coerce import coerce, hints_of, parse_value, show
from .errors import ConfigError, ProblemList, closest, did_you_mean
from .tree import all_paths, field_meta, get_path

_REF = re.compile(r"\$\{((?:[^{}]|\{\})+)\}")     # an empty {} may stand inside (a default)


def resolve_interpolations(cfg: Any) -> None:
    """Replace every reference in the tree in place; one ConfigError lists all bad references."""
    problems = ProblemList()
    _walk(cfg, cfg, "", problems)
    problems.raise_if_any()


def _walk(root: Any, node: Any, prefix: str, problems: ProblemList) -> None:
    """Resolve the fields of one group, recursing into sub-groups."""
    for name, tp in hints_of(type(node)).items():
        value, path = getattr(node, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            _walk(root, value, path + ".", problems)
            continue
        if not _has_ref(value):
            continue
        try:
            resolved = _resolve_value(root, value, path, [path])
        except ConfigError as err:
            problems.add(str(err))
            continue
        try:
            setattr(node, name, coerce(resolved, tp, path, meta=field_meta(type(node), name)))
        except ConfigError as err:
            problems.add(f"{err} (The value came from {show(value)}.)")


def _has_ref(value: Any) -> bool:
    """True if a string (or any string nested in lists/dicts) contains a ``${...}``."""
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    if isinstance(value, dict):
        return any(_has_ref(v) for v in value.values())
    return False


def _resolve_value(root: Any, value: Any, path: str, stack: list[str]) -> Any:
    """Resolve references in a string, list or dict value."""
    if isinstance(value, list):
        return [_resolve_value(root, v, path, stack) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_value(root, v, path, stack) for k, v in value.items()}
    if not isinstance(value, str) or "${" not in value:
        return value
    whole = _REF.fullmatch(value.strip())
    if whole:
        return _lookup(root, whole.group(1).strip(), path, stack)
    return _REF.sub(lambda m: _as_text(_lookup(root, m.group(1).strip(), path, stack)), value)


def _as_text(value: Any) -> str:
    """Text form of a referenced value inside a longer string."""
    return value if isinstance(value, str) else show(value)


def _lookup(root: Any, expr: str, path: str, stack: list[str]) -> Any:
    """Value of one reference expression (a dotted key, oc.env or oc.select)."""
    if expr.startswith("oc.env:"):
        name, _, default = expr[len("oc.env:"):].partition(",")
        if name.strip() in os.environ:
            return os.environ[name.strip()]
        if default:
            return parse_value(default.strip())
        raise ConfigError(f"{path} refers to environment variable {name.strip()} (via ${{{expr}}}), which is "
                          f"not set. Fix: export it, or give a default: ${{oc.env:{name.strip()},VALUE}}.")
    if expr.startswith("oc.select:"):
        target, _, default = expr[len("oc.select:"):].partition(",")
        try:
            return _lookup(root, target.strip(), path, stack)
        except ConfigError:
            return parse_value(default.strip()) if default else None
    return _lookup_key(root, _absolute(expr, path), path, stack)


def _absolute(key: str, path: str) -> str:
    """OmegaConf's relative reference: ``.x`` is a key beside ``path``, ``..x`` one level up, and so on."""
    if not key.startswith("."):
        return key
    rest = key.lstrip(".")
    up = len(key) - len(rest)
    return ".".join(path.split(".")[:-up] + [rest])


_MISSING = object()


def _verl_value(root: Any, key: str) -> Any:
    """A verl key lathe has no field for, as set (``root.verl_keys``): one key, or a group of them as a mapping."""
    held = getattr(root, "verl_keys", None) or {}
    if key in held:
        return held[key]
    below = {k[len(key) + 1:]: v for k, v in held.items() if k.startswith(key + ".")}
    if not below:
        return _MISSING
    out: dict = {}
    for sub, value in below.items():
        *parents, leaf = sub.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _lookup_key(root: Any, key: str, path: str, stack: list[str]) -> Any:
    """Value of a dotted key, itself resolved; errors on unknown keys, groups and cycles."""
    if key in stack:
        cycle = ", ".join(sorted(set(stack[stack.index(key):])))
        raise ConfigError(f"Circular ${{...}} references among {cycle}: none of them can be resolved. "
                          f"Fix: set one of these keys to a plain value.")
    try:
        target = get_path(root, key)
    except KeyError:
        target = _verl_value(root, key)
    if target is _MISSING:
        hint = did_you_mean(closest(key, all_paths(type(root)), n=2))
        raise ConfigError(f"{path} refers to ${{{key}}}, but `{key}` is not a config key.{hint} "
                          f"Fix: correct the reference or replace it with a value.") from None
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"{path} refers to ${{{key}}}, which is a group, not a value. "
                          f"Fix: refer to one of its keys, e.g. ${{{key}.SOME_KEY}}.")
    if _has_ref(target):
        return _resolve_value(root, target, key, stack + [key])
    return target
