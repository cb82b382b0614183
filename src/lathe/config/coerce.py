"""Field declaration helper, a strict YAML dialect, and value coercion from type annotations.

* ``spec(default, help)`` declares a dataclass field with its documentation in
  ``metadata["help"]`` (the one place lathe keeps per-key help).
* YAML is read with YAML 1.2 core scalars: only ``true``/``false`` are booleans (``yes``/``on``
  stay strings) and ``1e-6`` is a float (PyYAML's 1.1 rules read it as a string).
* ``coerce(value, annotation, key)`` checks and converts one value to a field's type and raises a
  ConfigError naming the key, the value and a fix when it cannot.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from .errors import ConfigError, closest, did_you_mean

# ----------------------------------------------------------------------------- field helper


def spec(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None, **meta: Any) -> Any:
    """Declare a documented dataclass field; list/dict defaults are copied per instance."""
    metadata = {"help": help, **meta}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------- YAML dialect

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^[-+]?(?:[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_REPLACED = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
             "tag:yaml.org,2002:timestamp"}


def _core_resolvers() -> dict:
    """SafeLoader's implicit resolvers minus YAML 1.1 bool/int/float/timestamp rules."""
    table = {}
    for first, items in yaml.SafeLoader.yaml_implicit_resolvers.items():
        table[first] = [(tag, rx) for tag, rx in items if tag not in _REPLACED]
    return table


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core booleans, integers and floats."""


class StrictDumper(yaml.SafeDumper):
    """SafeDumper that quotes any string either YAML 1.1 or 1.2 would read as a non-string."""


StrictLoader.yaml_implicit_resolvers = _core_resolvers()
for _tag, _rx, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
):
    StrictLoader.add_implicit_resolver(_tag, _rx, _first)
    StrictDumper.add_implicit_resolver(_tag, _rx, _first)


def _int_constructor(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    """Build ints written as decimal, 0x.. or 0o.. (YAML 1.2 core)."""
    text = loader.construct_scalar(node)
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    if body.startswith(("0x", "0o")):
        return sign * int(body[2:], 16 if body[1] == "x" else 8)
    return sign * int(body)


StrictLoader.add_constructor("tag:yaml.org,2002:int", _int_constructor)


def load_yaml(text: str) -> Any:
    """Parse YAML text with the strict dialect."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader


def dump_yaml(data: Any) -> str:
    """Dump plain data as block-style YAML that load_yaml (and YAML 1.1 readers) read back equal."""
    return yaml.dump(data, Dumper=StrictDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def parse_value(text: str) -> Any:
    """Parse an override's right-hand side as one YAML value ('1e-6' -> 1e-06, '[a,b]' -> list)."""
    if text.strip() == "":
        return ""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


# ----------------------------------------------------------------------------- coercion

_WHOLE_INTERP = re.compile(r"^\$\{[^{}]+\}$")


def is_interpolation(value: Any) -> bool:
    """True for a string that is exactly one ``${...}`` reference (resolved later, typed)."""
    return isinstance(value, str) and bool(_WHOLE_INTERP.match(value.strip()))


def type_name(tp: Any) -> str:
    """Human name of an annotation: 'int', 'float or null', 'one of: a, b', 'list of str'."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _fail(key: str, value: Any, tp: Any, example: Any, extra: str = "") -> ConfigError:
    """Build the standard type error for ``key``."""
    fix = f" Fix: e.g. {key}={show(example)}." if example is not None and not isinstance(example, dict) else ""
    return ConfigError(f"{key}={show(value)} is not valid: expected {type_name(tp)}.{extra}{fix}")


def show(value: Any) -> str:
    """Render a value the way a user would type it in an override (null, true, [a,b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value) if not isinstance(value, str) or value else "''"


def coerce(value: Any, tp: Any, key: str, *, raw: str | None = None, example: Any = None,
           meta: dict | None = None) -> Any:
    """Check ``value`` against annotation ``tp`` and return it converted (ints -> floats, ...).

    ``raw`` is the override's text before YAML parsing: a str field keeps it verbatim (so
    ``experiment_name=0.10`` stays "0.10"). A whole-string ``${...}`` reference is accepted for
    any type and checked after interpolation.
    """
    meta = meta or {}
    if is_interpolation(value):
        return value
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return copy.deepcopy(value)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, args, key, raw, example, meta)
    if value is None:
        if tp is dict or origin is dict:
            return {}
        raise ConfigError(f"{key} cannot be null: expected {type_name(tp)}."
                          + (f" Fix: e.g. {key}={show(example)}." if example is not None else ""))
    if origin is Literal:
        return _coerce_literal(value, args, key, raw)
    if origin is list:
        return _coerce_list(value, tp, args, key, example, meta)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _fail(key, value, tp, None, f" Set sub-keys as {key}.NAME=VALUE or give a mapping.")
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"{key} is a group of settings, not a single value (got {show(value)}). "
                          f"Fix: set its keys, e.g. {key}.SOME_KEY=VALUE.")
    return _coerce_scalar(value, tp, key, raw, example)


def _coerce_union(value: Any, tp: Any, args: tuple, key: str, raw: str | None, example: Any, meta: dict) -> Any:
    """Try each member of a Union/Optional in order; None is accepted only when NoneType is a member."""
    if value is None and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    for member in members:
        try:
            return coerce(value, member, key, raw=raw, example=example, meta=meta)
        except ConfigError as err:
            if len(members) == 1:  # Optional[X]: X's own message is the most specific
                raise ConfigError(f"{err} (null is also accepted.)") from None
    raise _fail(key, value, tp, example)


def _coerce_literal(value: Any, choices: tuple, key: str, raw: str | None) -> Any:
    """Accept only one of the declared choices; suggest the closest on a typo."""
    candidate = _unquote(raw.strip()) if raw is not None and isinstance(value, (str, int, float)) else value
    for choice in choices:
        if candidate == choice or (isinstance(choice, str) and str(candidate) == choice):
            return choice
    names = [str(c) for c in choices]
    hint = did_you_mean(closest(str(candidate), names, n=1))
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    raise ConfigError(f"{key}={show(value)} is not one of the values this key takes.{hint} Fix: set it to {listed}.")


def _coerce_list(value: Any, tp: Any, args: tuple, key: str, example: Any, meta: dict) -> list:
    """Coerce every item; a lone scalar becomes a 1-item list where the field allows it."""
    if not isinstance(value, (list, tuple)):
        if meta.get("scalar_to_list") and isinstance(value, str):
            value = [value]
        else:
            raise _fail(key, value, tp, example, " Write lists as [a,b].")
    item_tp = args[0] if args else Any
    return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]


def _coerce_scalar(value: Any, tp: Any, key: str, raw: str | None, example: Any) -> Any:
    """bool / int / float / str rules: bool only from true/false, ints accepted for floats."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _fail(key, value, tp, example, " Only true or false are accepted.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+", value.strip()):    # (strip: as int() would)
            return int(value.strip())
        raise _fail(key, value, tp, example, " A whole number is required.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _fail(key, value, tp, example)
    if tp is str:
        if isinstance(value, (list, dict, tuple)) or isinstance(value, bool) and raw is None:
            raise _fail(key, value, tp, example)
        if raw is not None:
            return _unquote(raw.strip())
        return value if isinstance(value, str) else str(value)
    raise ConfigError(f"{key}: unsupported annotation {tp!r} (a bug in lathe's config schema).")


def _unquote(text: str) -> str:
    """Strip one pair of matching surrounding quotes, as a shell user may leave them."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def hints_of(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (cached on the class)."""
    cache = cls.__dict__.get("_lathe_hints")
    if cache is None:
        cache = typing.get_type_hints(cls)
        setattr(cls, "_lathe_hints", cache)
    return cache
