"""Tool calls parsed from a model turn: hermes and llama3_json, good, several and malformed calls."""

import json

import pytest

from lathe.rollout.agent.parser import (
    PARSERS,
    ToolCall,
    get_parser,
    parse_hermes,
    parse_llama3_json,
)


def test_hermes_one_call_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("calculator", {"expression": "2+2"})]
    assert turn.content == "Let me compute."
    assert turn.errors == []


def test_hermes_several_calls_and_string_arguments():
    text = ('A <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> B\n'
            '<tool_call>  {"name": "b", "arguments": "{\\"y\\": [1, 2]}"}  </tool_call>\n'
            '<tool_call>{"name": "c"}</tool_call> C')
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]
    assert turn.content == "A  B\n\n C"
    assert turn.errors == []


def test_hermes_without_calls_is_content():
    turn = parse_hermes("  The answer is 42.  ")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 42.", [], [])


@pytest.mark.parametrize("body, message", [
    ('{"name": "a" "arguments": {}}', "tool call 2 is not valid JSON: Expecting ',' delimiter at char 13"),
    ('[1, 2]', "tool call 2 is not a JSON object (got list)"),
    ('{"arguments": {}}', 'tool call 2 has no "name"'),
    ('{"name": 3, "arguments": {}}', 'tool call 2 has a "name" that is not a non-empty string'),
    ('{"name": "a", "arguments": [1]}', 'tool call 2 (a): "arguments" must be a JSON object, not list'),
    ('{"name": "a", "arguments": "{oops"}', 'tool call 2 (a): "arguments" is a string that is not valid JSON'),
    ('[' * 100_000, "tool call 2 is not valid JSON"),
])
def test_hermes_malformed_call_is_an_error_for_the_model(body, message):
    text = f'<tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call> text <tool_call>{body}</tool_call>'
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("ok", {})]
    assert len(turn.errors) == 1
    assert turn.errors[0].startswith(message)
    assert turn.errors[0].endswith('Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    assert turn.content == "text"


def test_hermes_unclosed_call():
    turn = parse_hermes('Sure. <tool_call>{"name": "a", "arguments": {}}')
    assert turn.calls == []
    assert turn.errors[0].startswith("tool call 1 has no closing </tool_call>")
    assert turn.content == "Sure."


def test_llama3_one_call_with_python_tag():
    turn = parse_llama3_json('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}<|eom_id|>')
    assert turn.calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert (turn.content, turn.errors) == ("", [])


def test_llama3_several_calls_and_arguments_key():
    text = ' {"name": "a", "parameters": {"s": "x;y"}} ; {"name": "b", "arguments": {"n": 2}};'
    turn = parse_llama3_json(text)
    assert turn.calls == [ToolCall("a", {"s": "x;y"}), ToolCall("b", {"n": 2})]
    assert turn.errors == []


def test_llama3_plain_text_is_content():
    turn = parse_llama3_json("  The answer is {x}.  ")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is {x}.", [], [])


@pytest.mark.parametrize("text, message", [
    ('{"name": "a", "parameters": ', "tool call 1 is not valid JSON"),
    ('{"name": "a", "parameters": {}} and more', "tool call 1 is followed by 'and more'"),
    ('{"name": "a", "parameters": {}}; {"parameters": {}}', 'tool call 2 has no "name"'),
])
def test_llama3_malformed(text, message):
    turn = parse_llama3_json(text)
    assert turn.errors and turn.errors[-1].startswith(message)
    assert 'Write {"name": ..., "parameters": {...}}' in turn.errors[-1]


def test_get_parser():
    assert get_parser("hermes") is parse_hermes
    assert get_parser("llama3_json") is parse_llama3_json
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.multi_turn\.format='qwen'.*hermes"):
        get_parser("qwen")


def test_parsers_never_raise():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", '"name"', '"arguments"', ":", ",", ";",
                              '"a"', "1e999", "null", "<|python_tag|>", " ", "\n", '"\\u00'])
    texts = st.lists(pieces | st.text(max_size=5), max_size=30).map("".join) | st.text()

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(texts)
    def check(text):
        for parse in PARSERS.values():
            turn = parse(text)
            assert all(isinstance(c.arguments, dict) and isinstance(c.name, str) for c in turn.calls)
            assert all(isinstance(e, str) for e in turn.errors)
            json.dumps([c.arguments for c in turn.calls])

    check()
