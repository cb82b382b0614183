"""Tool calls parsed from the text of one model turn.

Two formats (`actor_rollout_ref.rollout.multi_turn.format`, verl's key):

* ``hermes`` (Qwen2.5 / Qwen3 chat templates): each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  block is one call; the text around the blocks is the turn's content.
* ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole turn, after an optional ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}``, or several such objects separated by ``;``. A turn that does not start
  with ``{`` is plain content.

A parser never raises: a malformed call becomes one entry of `ParsedTurn.errors`, a message written for the model
(the agent loop returns it as that call's tool answer) that says what was wrong and how to write a call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PARSERS", "ParsedTurn", "ToolCall", "get_parser", "parse_hermes", "parse_llama3_json"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_HINT = 'Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
LLAMA3_TAG = "<|python_tag|>"
LLAMA3_END_MARKERS = ("<|eom_id|>", "<|eot_id|>")
LLAMA3_HINT = 'Write {"name": ..., "parameters": {...}}, several separated by ";"'


@dataclass
class ToolCall:
    name: str
    arguments: dict                   # always a dict (a JSON string of arguments is decoded)


@dataclass
class ParsedTurn:
    content: str                      # the turn's text without its tool-call blocks, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # one message per malformed call, for the model to read


def _json_error(e: Exception) -> str:
    """A short description of why `json.loads` failed (`JSONDecodeError` gives a char position)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at char {e.pos}"
    if isinstance(e, RecursionError):
        return "it is nested too deeply"
    return str(e)[:200]


def _to_call(obj: object, number: int, args_key: str, hint: str) -> ToolCall | str:
    """A decoded call object as a `ToolCall`, or the error message for the model. `args_key` is the format's
    name for the arguments ("arguments" or "parameters"); the other name is accepted too."""
    if not isinstance(obj, dict):
        return f"tool call {number} is not a JSON object (got {type(obj).__name__}). {hint}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        what = "has no \"name\"" if name is None else "has a \"name\" that is not a non-empty string"
        return f"tool call {number} {what}. {hint}"
    other = "parameters" if args_key == "arguments" else "arguments"
    args = obj.get(args_key, obj.get(other))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return (f"tool call {number} ({name}): \"{args_key}\" is a string that is not valid JSON: "
                    f"{_json_error(e)}. {hint}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"tool call {number} ({name}): \"{args_key}\" must be a JSON object, not {type(args).__name__}. {hint}"
    return ToolCall(name=name.strip(), arguments=args)


def _decode_call(body: str, number: int, args_key: str, hint: str) -> ToolCall | str:
    """Decode one call's JSON text; the `ToolCall` or the error message."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return f"tool call {number} is not valid JSON: {_json_error(e)}. {hint}"
    return _to_call(obj, number, args_key, hint)


def _add(turn: ParsedTurn, result: ToolCall | str) -> None:
    if isinstance(result, ToolCall):
        turn.calls.append(result)
    else:
        turn.errors.append(result)


def parse_hermes(text: str) -> ParsedTurn:
    """Calls written as ``<tool_call>{json}</tool_call>`` blocks (Qwen2.5 / Qwen3, Hermes)."""
    turn, pieces, pos, number = ParsedTurn(content=""), [], 0, 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        number += 1
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end < 0:
            turn.errors.append(f"tool call {number} has no closing {HERMES_CLOSE}. {HERMES_HINT}")
            break
        _add(turn, _decode_call(text[start + len(HERMES_OPEN):end], number, "arguments", HERMES_HINT))
        pos = end + len(HERMES_CLOSE)
    turn.content = "".join(pieces).strip()
    return turn


def parse_llama3_json(text: str) -> ParsedTurn:
    """A turn that is one JSON call object, or several separated by ``;`` (Llama 3.1 / 3.2)."""
    body = text.strip()
    body = body.removeprefix(LLAMA3_TAG).strip() if body.startswith(LLAMA3_TAG) else body
    for marker in LLAMA3_END_MARKERS:
        body = body.removesuffix(marker).rstrip()
    if not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    turn, decoder, pos, number = ParsedTurn(content=""), json.JSONDecoder(), 0, 0
    while pos < len(body):
        number += 1
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            turn.errors.append(f"tool call {number} is not valid JSON: {_json_error(e)}. {LLAMA3_HINT}")
            break
        _add(turn, _to_call(obj, number, "parameters", LLAMA3_HINT))
        rest = body[pos:].lstrip()
        if rest and not rest.startswith(";"):
            turn.errors.append(f"tool call {number} is followed by {rest[:30]!r}; separate calls with \";\" and "
                               f"write nothing else in a turn that calls tools. {LLAMA3_HINT}")
            break
        pos = len(body) - len(rest) + 1          # past the ";"
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return turn


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def get_parser(fmt: str) -> Callable[[str], ParsedTurn]:
    """The parser of tool-call format `fmt` (`actor_rollout_ref.rollout.multi_turn.format`)."""
    try:
        return PARSERS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={fmt!r} is not a known tool-call format; "
                         f"use one of {sorted(PARSERS)} (hermes: Qwen2.5/Qwen3, llama3_json: Llama 3.1/3.2)") from None
