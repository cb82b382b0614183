"""`lathe generate` with tools (`lathe.cli.generate_tools`): with no tool calls the tool loop samples what plain
generation samples; tool keys and rows are checked before any model loads; a scripted engine's tool calls are
written as trajectories (loss mask, turns, calls, errors, text)."""

import json
import logging

import pytest

from lathe.cli.generate import _run, generate_file
from lathe.cli.generate_options import GenerateError, GenerateOptions, parse_options
from lathe.cli.generate_rows import read_rows, tokenize_rows
from lathe.cli.generate_tools import ToolSetup, load_toolset

from cli.test_generate import _write, save_tiny_model
from helpers import qwen_style_tokenizer
from rollout.agent.test_loop import CALL, ScriptedEngine

CALCULATOR = "lathe.rollout.agent.builtin_tools.CalculatorTool"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("generate-tools") / "qwen3-chars")


@pytest.fixture
def tools_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {CALCULATOR}\n    config: {{type: native}}\n")
    return path


def _generate(tiny, tmp_path, rows, *items, name="out.jsonl"):
    inp, out = _write(tmp_path / "in.jsonl", rows), tmp_path / name
    stats = generate_file(tiny[0], inp, out, list(items))
    return [json.loads(line) for line in out.read_text().splitlines()], stats


def test_with_tools_but_no_calls_the_samples_are_plain_generations(tiny, tmp_path, tools_yaml):
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in ("1+2=", "hi", "What is 6*7?")]
    rows[1]["extra_info"] = {"tools_kwargs": {"calculator": {"create_kwargs": {}}}, "index": 1}
    keys = ["n=2", "temperature=1.0", "max_tokens=12", "seed=5", "batch_size=2"]
    # with tools the template's end-of-turn token (<|end|>, id 6) also ends a turn: give it to the plain run
    plain, _ = _generate(tiny, tmp_path, rows, *keys, "stop_token_ids=6", name="plain.jsonl")
    tooled, stats = _generate(tiny, tmp_path, rows, *keys, f"tool_config_path={tools_yaml}", "max_assistant_turns=3")
    assert set(plain[0]["outputs"][0]) == {"token_ids", "text", "logprobs", "finish_reason"}
    assert len({tuple(s["token_ids"]) for r in plain for s in r["outputs"]}) > 1
    for p, t in zip(plain, tooled):
        assert {k: v for k, v in t.items() if k != "outputs"} == {k: v for k, v in p.items() if k != "outputs"}
        for ps, ts in zip(p["outputs"], t["outputs"], strict=True):
            assert ts["token_ids"] == ps["token_ids"] and ts["text"] == ps["text"]
            assert ts["finish_reason"] == ps["finish_reason"]
            assert ts["logprobs"] == pytest.approx(ps["logprobs"], abs=1e-5)
            assert ts["loss_mask"] == [1] * len(ts["token_ids"])
            assert (ts["num_turns"], ts["tool_calls"], ts["tool_errors"], ts["tool_rewards"]) == (2, 0, 0, {})
    assert stats.tools and stats.tool_calls == 0 and stats.samples == 6


def test_tool_keys_need_a_tool_file_and_valid_values():
    with pytest.raises(ValueError, match="tool_format.*hermes"):
        parse_options(["tool_config_path=t.yaml", "tool_format=xml"])
    with pytest.raises(GenerateError, match="max_assistant_turns=3 needs tool_config_path.*drop max_assistant_turns"):
        parse_options(["max_assistant_turns=3"])
    with pytest.raises(GenerateError, match="tool_timeout=30.0 needs tool_config_path"):
        parse_options(["tool_timeout=30"])                 # even at its default: a key given must act
    with pytest.raises(GenerateError, match="max_parallel_calls=0"):
        parse_options(["tool_config_path=t.yaml", "max_parallel_calls=0"])
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        parse_options(["tool_config_path=t.yaml", "tool_response_truncate_side=top"])
    assert parse_options(["tool_config_path=t.yaml", "max_user_turns=2"]).max_user_turns == 2


@pytest.mark.parametrize("problem", ["missing", "bad-yaml", "bad-class", "in-code"])
def test_a_bad_tool_setup_fails_before_any_model_loads(tmp_path, problem):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    tools = tmp_path / "tools.yaml"
    tools.write_text({"bad-yaml": "tools: [class_name: {", "bad-class": "tools:\n  - class_name: no.such.Tool\n"}
                     .get(problem, ""))
    path = tmp_path / "none.yaml" if problem == "missing" else tools
    options = GenerateOptions(max_user_turns=2) if problem == "in-code" else [f"tool_config_path={path}"]
    with pytest.raises(GenerateError) as e:
        generate_file(tmp_path / "no-such-model", inp, tmp_path / "out.jsonl", options)
    assert (("max_user_turns=2 needs tool_config_path" if problem == "in-code" else str(path)) in str(e.value))
    assert problem != "bad-class" or "no.such.Tool" in str(e.value)


def test_a_builtin_tool_config_needs_no_file_and_an_unknown_one_is_named():
    assert [s["function"]["name"] for s in load_toolset(GenerateOptions(tool_config_path="builtin:secret_lookup"))
            .schemas()] == ["f"]
    with pytest.raises(GenerateError, match="builtin:nope: no such built-in tool config"):
        load_toolset(GenerateOptions(tool_config_path="builtin:nope"))


@pytest.mark.parametrize("extra, field", [
    ("[1]", "field 'extra_info'"),
    ('{"tools_kwargs": [1]}', "field 'extra_info.tools_kwargs'"),
    ('{"tools_kwargs": {"calculator": 3}}', "field 'extra_info.tools_kwargs.calculator'"),
    ('{"tools_kwargs": {"calculator": {"create_kwargs": "x"}}}', "'extra_info.tools_kwargs.calculator.create_kwargs'"),
])
def test_bad_tools_kwargs_are_named_by_row(tmp_path, tools_yaml, extra, field):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "ok", "extra_info": {"index": 0}}\n{"prompt": "hi", "extra_info": %s}\n' % extra)
    with pytest.raises(GenerateError) as e:
        generate_file(tmp_path / "no-such-model", inp, tmp_path / "out.jsonl", [f"tool_config_path={tools_yaml}"])
    assert f"{inp} line 2" in str(e.value) and field in str(e.value) and "create_kwargs" in str(e.value)


def test_a_prompt_with_no_room_for_tool_turns_is_named(tiny, tmp_path, tools_yaml):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "fine"}, {"prompt": "x" * 40}])
    with pytest.raises(GenerateError, match="line 2.*prompt \\+ max_tokens=30 must fit max_model_len=64"):
        generate_file(tiny[0], inp, tmp_path / "out.jsonl", [f"tool_config_path={tools_yaml}", "max_tokens=30"])


def test_tool_calls_are_written_as_trajectories(tmp_path, tools_yaml, caplog):
    """Through `_run` with a scripted engine (a random model calls no tools): row 0 calls the calculator, row 1 answers
    at once, row 2 makes a call the calculator refuses."""
    tok = qwen_style_tokenizer()
    script = [[CALL % "6*7", "It is 42."], ["No tool needed."], [CALL % "import os", "Sorry."]]
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in ("What is 6*7?", "Hi", "List files")]
    rows[0]["extra_info"] = {"tools_kwargs": {"calculator": {"create_kwargs": {}}}}
    opts = parse_options([f"tool_config_path={tools_yaml}", "max_tokens=400", "seed=1", "batch_size=3"])
    tools = ToolSetup.load(opts)
    prompt_rows = read_rows(_write(tmp_path / "in.jsonl", rows))
    tools.check_rows(prompt_rows)
    prompts = tokenize_rows(prompt_rows, tok, vocab_size=len(tok), max_model_len=2048,
                            tools=tools.check_tokenizer(tok))
    assert '"name": "calculator"' in tok.decode(prompts[0])          # the schemas are in the chat prompt
    engine, out = ScriptedEngine(tok, script), tmp_path / "out.jsonl"
    with caplog.at_level(logging.INFO, logger="lathe"):
        stats = _run(engine, tok, prompt_rows, prompts, opts, out, tools.runner(engine, tok))
    got = [json.loads(line)["outputs"][0] for line in out.read_text().splitlines()]
    for sample in got:
        assert len(sample["loss_mask"]) == len(sample["token_ids"]) == len(sample["logprobs"])
        assert sample["text"] == tok.decode(sample["token_ids"], skip_special_tokens=True)
    first, plain, refused = got
    appended = tok.decode([t for t, m in zip(first["token_ids"], first["loss_mask"]) if not m])
    assert appended == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert first["text"].startswith(CALL % "6*7") and first["text"].endswith("It is 42.")
    assert (first["num_turns"], first["tool_calls"], first["tool_errors"]) == (4, 1, 0)
    assert first["tool_rewards"] == {"calculator": 0.0} and first["finish_reason"] == "stop"
    assert plain["loss_mask"] == [1] * len(plain["token_ids"]) and plain["text"] == "No tool needed."
    assert (plain["num_turns"], plain["tool_calls"], plain["tool_rewards"]) == (2, 0, {})
    assert (refused["num_turns"], refused["tool_calls"], refused["tool_errors"]) == (4, 1, 1)
    assert "calculator" in refused["text"] and refused["text"].endswith("Sorry.")
    assert (stats.tool_calls, stats.tool_errors) == (2, 1)
    assert "2 tool calls, 1 tool errors" in caplog.text


def test_function_tools_alone_run_the_tool_loop(tmp_path):
    """`function_tool_path=` (a file of @function_tool functions) turns the loop on as a tool YAML does; its errors
    name that option."""
    path = tmp_path / "fn_tools.py"
    path.write_text("from lathe.rollout.agent.function_tools import function_tool\n\n\n"
                    "@function_tool\n"
                    "def calculator(expression: str) -> str:\n"
                    "    '''Evaluate a product.\n\n    Args:\n        expression: a*b\n    '''\n"
                    "    a, b = expression.split('*')\n"
                    "    return str(int(a) * int(b))\n")
    tok = qwen_style_tokenizer()
    opts = parse_options([f"function_tool_path={path}", "max_tokens=400", "seed=1"])
    tools = ToolSetup.load(opts)
    rows = read_rows(_write(tmp_path / "in.jsonl", [{"prompt": [{"role": "user", "content": "What is 6*7?"}]}]))
    tools.check_rows(rows)
    prompts = tokenize_rows(rows, tok, vocab_size=len(tok), max_model_len=2048, tools=tools.check_tokenizer(tok))
    assert '"name": "calculator"' in tok.decode(prompts[0])
    engine, out = ScriptedEngine(tok, [[CALL % "6*7", "It is 42."]]), tmp_path / "out.jsonl"
    _run(engine, tok, rows, prompts, opts, out, tools.runner(engine, tok))
    sample = json.loads(out.read_text())["outputs"][0]
    answer = tok.decode([t for t, m in zip(sample["token_ids"], sample["loss_mask"]) if not m])
    assert "<tool_response>\n42\n</tool_response>" in answer and (sample["tool_calls"], sample["tool_errors"]) == (1, 0)
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(GenerateError, match="function_tool_path=.*none.py: the file registers no tools"):
        load_toolset(parse_options([f"function_tool_path={tmp_path / 'none.py'}"]))
