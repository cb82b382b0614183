"""Tools from a Python file of `@function_tool` functions (`lathe.rollout.agent.function_tools`, verl's
`rollout.multi_turn.function_tool_path`): the schema each function gives, the answers it returns, every mistake."""

import json
import textwrap

import pytest

from lathe.config import load_config
from lathe.rollout.agent import load_run_tools
from lathe.rollout.agent.function_tools import load_function_tools
from lathe.rollout.agent.parser import ToolCall
from lathe.rollout.agent.tools import ToolConfigError, ToolSet

HEADER = "from lathe.rollout.agent.function_tools import function_tool\n"
TOOLS = HEADER + textwrap.dedent('''
    import asyncio

    @function_tool
    def add(a: int, b: int = 2) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    @function_tool("weather")
    async def forecast(city: str) -> dict:
        """Tomorrow's weather.

        Args:
            city: where
        """
        await asyncio.sleep(0)
        return {"city": city, "sky": "clear"}

    @function_tool(schema={"type": "function", "function": {"name": "graded", "description": "a graded answer",
                                                             "parameters": {"type": "object", "properties": {}}}})
    def graded():
        return "ok", 0.5, {"calls": 1}
''')


def write(tmp_path, text, name="tools.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def call(tools, name, arguments):
    return ToolSet(tools).open("t").call(ToolCall(name, arguments), timeout_s=5)


def test_each_function_is_a_tool_with_its_inferred_schema_and_answers_as_verl_reads_it(tmp_path):
    tools = load_function_tools(write(tmp_path, TOOLS))
    assert [t.name for t in tools] == ["add", "weather", "graded"]
    add = tools[0].tool_schema["function"]
    assert add["description"] == "Add two numbers."
    assert add["parameters"] == {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer", "description": "the first"}, "b": {"type": "integer", "description": "the second"}}}
    result = call(tools, "add", {"a": 3})
    assert (result.text, result.error) == ("5", False)
    weather = call(tools, "weather", {"city": "Oslo"})
    assert json.loads(weather.text) == {"city": "Oslo", "sky": "clear"}
    graded = call(tools, "graded", {})
    assert (graded.text, graded.reward, graded.metrics) == ("ok", 0.5, {"calls": 1})
    wrong = call(tools, "add", {"c": 1})
    assert wrong.error and "add error" in wrong.text, "a bad call is an answer for the model"
    assert load_function_tools(tmp_path / "tools.py") == tools, "the file runs once"


@pytest.mark.parametrize("text, match", [
    ("from verl.tools.function_tool import function_tool\n", "from lathe.rollout.agent.function_tools import"),
    ("x = 1\n", "registers no tools"),
    (HEADER + "@function_tool\ndef f(x):\n    return x\n", "cannot be inferred"),
    (HEADER + "@function_tool\ndef f(*args) -> str:\n    '''F.'''\n    return ''\n", r"\*args/\*\*kwargs"),
    (HEADER + "@function_tool('g')\ndef f() -> str:\n    '''F.'''\n\n@function_tool('g')\ndef h() -> str:\n"
     "    '''H.'''\n", "two functions register"),
    ("raise RuntimeError('boom')\n", "running it failed: RuntimeError: boom"),
])
def test_what_is_wrong_in_a_function_tool_file_is_said(tmp_path, text, match):
    with pytest.raises(ToolConfigError, match=match) as err:
        load_function_tools(write(tmp_path, text, name=f"bad_{abs(hash(text))}.py"))
    assert "function_tool_path" in str(err.value) or "@function_tool" in str(err.value)


def test_a_run_takes_the_function_tools_beside_its_tool_file_and_refuses_a_name_in_both(tmp_path):
    functions = write(tmp_path, TOOLS)
    yaml = tmp_path / "tools.yaml"
    yaml.write_text("tools:\n  - class_name: lathe.rollout.agent.builtin_tools.CalculatorTool\n"
                    "    config: {type: native}\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(None, [f"{mt}.enable=true", f"{mt}.tool_config_path={yaml}",
                             f"{mt}.function_tool_path={functions}"])
    assert sorted(load_run_tools(cfg).tools) == ["add", "calculator", "graded", "weather"]
    only = load_config(None, [f"{mt}.enable=true", f"{mt}.function_tool_path={functions}"])
    assert sorted(load_run_tools(only).tools) == ["add", "graded", "weather"]
    clash = write(tmp_path, HEADER + "@function_tool(schema={'type': 'function', 'function': {'name': 'calculator', "
                                     "'description': 'c', 'parameters': {'type': 'object', 'properties': {}}}})\n"
                                     "def calc():\n    return '0'\n", name="clash.py")
    both = load_config(None, [f"{mt}.enable=true", f"{mt}.tool_config_path={yaml}", f"{mt}.function_tool_path={clash}"])
    with pytest.raises(ToolConfigError, match=r"\['calculator'\] are declared both"):
        load_run_tools(both)


def test_a_missing_function_tool_file_fails_at_load_and_a_single_turn_run_is_told_it_is_unused(tmp_path):
    from lathe.config import ConfigError
    mt = "actor_rollout_ref.rollout.multi_turn"
    with pytest.raises(ConfigError, match=r"function_tool_path='/nowhere.py': no such file\. Fix"):
        load_config(None, [f"{mt}.enable=true", f"{mt}.function_tool_path=/nowhere.py"])
    with pytest.warns(UserWarning, match="function_tool_path"):
        load_config(None, [f"{mt}.function_tool_path={write(tmp_path, TOOLS)}"])


def test_a_python_file_given_as_the_tool_yaml_is_pointed_to_function_tool_path(tmp_path):
    from lathe.rollout.agent.tool_config import load_tools
    with pytest.raises(ToolConfigError, match="a Python file where a tool YAML is read .* function_tool_path"):
        load_tools(write(tmp_path, TOOLS))
