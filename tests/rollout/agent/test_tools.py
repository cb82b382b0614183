"""verl-shaped tools: loading tool configs (and every mistake in them), sessions, timeouts, the built-ins."""

import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lathe.reward import sandbox
from lathe.rollout.agent import builtin_tools
from lathe.rollout.agent.builtin_tools import (
    CalculatorTool,
    CodeInterpreterTool,
    Geo3kTool,
    Gsm8kTool,
)
from lathe.rollout.agent.parser import ToolCall
from lathe.rollout.agent.tool_config import load_tools
from lathe.rollout.agent.tools import BaseTool, ToolConfigError, ToolResponse, ToolSet


def schema(name: str, *required: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in required}, "required": list(required)}}}


class EchoTool(BaseTool):
    """async, verl's 3-tuple; counts its instances."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("echo", "text"))
        self.created, self.released = {}, []

    async def create(self, instance_id=None, **kwargs):
        self.created[instance_id] = kwargs
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=f"echo:{parameters['text']}"), 0.5, {"chars": len(parameters["text"])}

    async def calc_reward(self, instance_id, **kwargs):
        return 2.0

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class SyncEchoTool(BaseTool):
    """plain def methods, returns a str; create takes its kwargs by name only (no **kwargs)."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("sync_echo", "text"))
        self.truth = {}

    def create(self, instance_id, ground_truth=None):
        self.truth[instance_id] = ground_truth
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        return f"sync:{parameters['text']}:{self.truth[instance_id]}"


class OddTool(BaseTool):
    def __init__(self, behaviour):
        super().__init__({}, schema("odd"))
        self.behaviour = behaviour

    def execute(self, instance_id, parameters, **kwargs):
        return self.behaviour()

    def release(self, instance_id, **kwargs):
        raise RuntimeError("release failed")


def session(*tools, kwargs=None, trajectory="t0"):
    return ToolSet(list(tools), release_timeout_s=2.0).open(trajectory, kwargs)


# ---- sessions ----

def test_sync_and_async_tools_and_their_results():
    echo, sync = EchoTool(), SyncEchoTool()
    s = session(echo, sync, kwargs={"sync_echo": {"create_kwargs": {"ground_truth": "7"}}})
    a = s.call(ToolCall("echo", {"text": "hi"}), timeout_s=5)
    assert (a.text, a.reward, a.error, a.metrics) == ("echo:hi", 0.5, False, {"chars": 2})
    b = s.call(ToolCall("sync_echo", {"text": "x"}), timeout_s=5)
    assert (b.text, b.reward, b.error) == ("sync:x:7", 0.0, False)
    assert s.rewards() == {"echo": 2.0, "sync_echo": 0.0}


@pytest.mark.parametrize("returned, text", [
    ("plain", "plain"), ({"text": "from dict"}, "from dict"), (ToolResponse(text=None), ""),
    ((ToolResponse(text="t"), None, None), "t"),
])
def test_execute_may_return_str_dict_response_or_tuple(returned, text):
    result = session(OddTool(lambda: returned)).call(ToolCall("odd", {}), timeout_s=5)
    assert (result.text, result.error) == (text, False)


def test_instances_are_created_once_per_trajectory_with_create_kwargs():
    echo = EchoTool()
    tools = ToolSet([echo])
    kwargs = {"echo": {"create_kwargs": {"ground_truth": "3"}}, "not_loaded": None}
    one, two = tools.open("t1", kwargs), tools.open("t2", None)
    for s in (one, one, two):
        assert not s.call(ToolCall("echo", {"text": "a"}), timeout_s=5).error
    # verl's two conventions: the create_kwargs spread, and as create_kwargs= (its agent loop's)
    assert echo.created == {"t1": {"ground_truth": "3", "create_kwargs": {"ground_truth": "3"}},
                            "t2": {"create_kwargs": {}}}
    one.close()
    one.close()
    assert echo.released == ["t1"]
    assert one.call(ToolCall("echo", {"text": "a"}), timeout_s=5).error


def test_unknown_tool_bad_arguments_exception_and_bad_return_are_answers():
    s = session(EchoTool(), OddTool(lambda: 1 / 0))
    unknown = s.call(ToolCall("search", {}), timeout_s=5)
    assert unknown.error and unknown.text == "there is no tool named 'search'; the tools are: echo, odd"
    bad = s.call(ToolCall("echo", {"txt": "a"}), timeout_s=5)
    assert bad.error and bad.text.startswith("echo error: missing key 'text'. Called with {\"txt\": \"a\"}")
    assert bad.text.endswith("its parameters: text (required)")
    assert s.call(ToolCall("odd", {}), timeout_s=5).text == "odd failed: ZeroDivisionError: division by zero"
    weird = session(OddTool(lambda: 3.5)).call(ToolCall("odd", {}), timeout_s=5)
    assert weird.error and "execute returned float; return a str" in weird.text
    exits = session(OddTool(lambda: sys.exit(3))).call(ToolCall("odd", {}), timeout_s=5)
    assert exits.error and "SystemExit" in exits.text


def test_timeout_answers_fast():
    s = session(OddTool(lambda: time.sleep(2)))
    start = time.monotonic()
    result = s.call(ToolCall("odd", {}), timeout_s=0.2)
    assert time.monotonic() - start < 1.0
    assert result.error and result.text == "odd timed out after 0.2 s and gave no answer"
    s.close()                                   # release raises: logged, not raised


def test_many_trajectories_at_once():
    echo = EchoTool()
    tools = ToolSet([echo])

    def trajectory(i):
        s = tools.open(f"t{i}")
        texts = [s.call(ToolCall("echo", {"text": f"{i}-{k}"}), timeout_s=5).text for k in range(3)]
        s.close()
        return texts

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(trajectory, range(24)))
    assert results == [[f"echo:{i}-{k}" for k in range(3)] for i in range(24)]
    assert sorted(echo.released) == sorted(f"t{i}" for i in range(24))
    assert threading.active_count() < 20        # tool threads end with their calls


def test_bad_tools_kwargs_is_refused():
    with pytest.raises(TypeError, match="extra_info.tools_kwargs of trajectory t0"):
        session(EchoTool(), kwargs={"echo": {"create_kwargs": "x"}})


def test_toolset_refuses_two_tools_of_one_name():
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        ToolSet([EchoTool(), EchoTool()])


# ---- built-ins ----

def test_gsm8k_tool_scores_and_step_rewards():
    s = session(Gsm8kTool(), kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
    steps = [s.call(ToolCall("calc_gsm8k_reward", {"answer": a}), timeout_s=5) for a in ("70", "72", "#### 72", 72)]
    assert [r.text for r in steps] == ["Current parsed answer='70' reward=0.0", "Current parsed answer='72' reward=1.0",
                                       "Current parsed answer='#### 72' reward=1.0",
                                       "Current parsed answer='72' reward=1.0"]
    assert [r.reward for r in steps] == [-0.05, 0.0, -0.05, -0.05]    # 0.0 only when it beats the last score
    assert s.rewards() == {"calc_gsm8k_reward": 1.0}
    s.call(ToolCall("calc_gsm8k_reward", {"answer": "1"}), timeout_s=5)
    assert s.rewards() == {"calc_gsm8k_reward": 0.0}                  # the latest submission counts


GEO3K_KWARGS = {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "2\\sqrt{3}"}}}


def test_geo3k_tool_scores_the_answer_and_step_rewards():
    s = session(Geo3kTool(), kwargs=GEO3K_KWARGS)
    answers = ("3", "\\sqrt{12}", "\\boxed{2\\sqrt{3}}", "the side is \\boxed{4}", "2*sqrt(3)")
    steps = [s.call(ToolCall("calc_geo3k_reward", {"answer": a}), timeout_s=30) for a in answers]
    assert not any(r.error for r in steps), [r.text for r in steps]
    assert [r.text for r in steps] == [f"Current parsed answer={a!r} reward={w!r}"
                                       for a, w in zip(answers, (0.0, 1.0, 1.0, 0.0, 1.0), strict=True)]
    assert [r.reward for r in steps] == [-0.05, 0.0, -0.05, -0.05, 0.0]   # 0.0 only when it beats the last score
    assert s.rewards() == {"calc_geo3k_reward": 1.0}                   # the latest submission counts
    s.call(ToolCall("calc_geo3k_reward", {"answer": 7}), timeout_s=30)   # a number is read as its text
    assert s.rewards() == {"calc_geo3k_reward": 0.0}
    s.close()


def test_geo3k_tool_has_no_format_part_and_numbers_compare_as_numbers():
    s = session(Geo3kTool(), kwargs={"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "24"}}})
    result = s.call(ToolCall("calc_geo3k_reward", {"answer": "<think>area</think> \\boxed{24.0}"}), timeout_s=30)
    assert result.text.endswith("reward=1.0"), "1.0, not the single-turn scorer's 0.9 + 0.1 split"
    assert s.rewards() == {"calc_geo3k_reward": 1.0}


def test_geo3k_tool_instances_are_per_trajectory_and_released():
    tool = Geo3kTool()
    tools = ToolSet([tool], release_timeout_s=2.0)
    a = tools.open("a", {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "5"}}})
    b = tools.open("b", {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "6"}}})
    for s in (a, b):
        s.call(ToolCall("calc_geo3k_reward", {"answer": "5"}), timeout_s=30)
    assert (a.rewards(), b.rewards()) == ({"calc_geo3k_reward": 1.0}, {"calc_geo3k_reward": 0.0})
    a.close()
    b.close()
    assert tool._instances == {}


@pytest.mark.parametrize("tool,data", [(Geo3kTool, "geo3k_tool"), (Gsm8kTool, "gsm8k_tool")])
def test_an_answer_tool_without_a_ground_truth_says_how_to_make_the_data(tool, data):
    s = session(tool())
    result = s.call(ToolCall(tool().name, {"answer": "3"}), timeout_s=30)
    assert result.error and "create_kwargs.ground_truth" in result.text and f"lathe preprocess {data}" in result.text
    assert s.rewards() == {}


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(1 + 2) ** 3", "27"), ("7 / 2", "3.5"), ("-3 // 2", "-2"), ("10 % 4", "2"),
    ("0.1 + 0.2", "0.3"), ("-(-2) ** 10", "-1024"), (" 1_000 * 3 ", "3000"), (12, "12"),
])
def test_calculator(expression, value):
    result = session(CalculatorTool()).call(ToolCall("calculator", {"expression": expression}), timeout_s=5)
    assert (result.text, result.error) == (value, False)


@pytest.mark.parametrize("expression, message", [
    ("9**9**9", "the result is too large"), ("10**3000 * 10**3000", "the result is too large"),
    ("1e308 * 10", "the result is too large"), ("2.0 ** 99999", "the result is too large"),
    ("__import__('os').system('true')", "function calls are not allowed"), ("x + 1", "names like 'x'"),
    ("(1).__class__", "Attribute is not allowed"), ("2 ^ 10", "'^' is not a power here"),
    ("1 / 0", "division by zero"), ("'a' * 3", "Constant is not allowed"), ("(-8) ** 0.5", "not a real number"),
    ("1 +", "is not an arithmetic expression"), ("1" * 501, "more than 500 characters"),
    ("(" * 249 + "1" + ")" * 249, "too many nested parentheses"), ("-" * 499 + "1", ""),
    ("[1, 2]", "List is not allowed"), ("lambda: 1", "Lambda is not allowed"),
])
def test_calculator_refuses_hostile_input_quickly(expression, message):
    start = time.monotonic()
    result = session(CalculatorTool()).call(ToolCall("calculator", {"expression": expression}), timeout_s=5)
    assert time.monotonic() - start < 1.0
    if message:
        assert result.error and result.text.startswith("calculator error: ") and message in result.text
    else:
        assert result.text in ("1", "-1")


def test_calculator_without_expression():
    result = session(CalculatorTool()).call(ToolCall("calculator", {}), timeout_s=5)
    assert result.error and "missing key 'expression'" in result.text


def test_code_interpreter_runs_python(tmp_path):
    reason = sandbox.unavailable()
    if reason:
        pytest.skip(reason)
    tool = CodeInterpreterTool(config={"default_timeout": 1, "max_output_chars": 200})
    s = session(tool)
    assert s.call(ToolCall("code_interpreter", {"code": "print(6*7)"}), timeout_s=10).text == "42"
    failed = s.call(ToolCall("code_interpreter", {"code": "print('a')\nraise ValueError('bad')"}), timeout_s=10)
    assert not failed.error and failed.text.startswith("a\n") and "ValueError: bad" in failed.text
    long = s.call(ToolCall("code_interpreter", {"code": "print('x' * 1000)"}), timeout_s=10).text
    assert len(long) < 260 and "characters cut" in long
    slow = s.call(ToolCall("code_interpreter", {"code": "while True: pass"}), timeout_s=10)
    assert slow.text.endswith("[timed out after 1 s]")


def test_code_interpreter_refuses_to_load_without_a_sandbox(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin_tools, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    path = write(tmp_path, """
        tools:
          - class_name: lathe.rollout.agent.builtin_tools.CodeInterpreterTool
            config: {type: native}
        """)
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: the code interpreter's local sandbox cannot run here: "
                                              r"bubblewrap \(bwrap\) is not installed"):
        load_tools(path)


# ---- tool configs ----

def write(tmp_path, text: str, name: str = "tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


VERL_CONFIG = """
    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
        config:
          type: native
        tool_schema:
          type: "function"
          function:
            name: "calc_gsm8k_reward"
            description: "A tool for calculating the reward of gsm8k"
            parameters:
              type: "object"
              properties:
                answer:
                  type: "string"
                  description: "The model's answer to the GSM8K math problem, must be a digits"
              required: ["answer"]
      - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
        config:
          type: native
          sandbox_fusion_url: "http://sandbox.invalid/run_code"
          default_timeout: 3
          memory_limit_mb: 512
          rate_limit: 8
          num_workers: 10
        tool_schema:
          type: "function"
          function:
            name: "code_interpreter"
            description: "A tool for executing code."
            parameters: {type: object, properties: {code: {type: string}}, required: [code]}
    """


def test_verl_tool_config_runs_unchanged(tmp_path):
    tools = load_tools(write(tmp_path, VERL_CONFIG))
    assert list(tools.tools) == ["calc_gsm8k_reward", "code_interpreter"]
    assert isinstance(tools.tools["calc_gsm8k_reward"], Gsm8kTool)
    code = tools.tools["code_interpreter"]
    assert isinstance(code, CodeInterpreterTool)
    assert (code.limits.url, code.limits.time_limit_s, code.limits.memory_limit_mb, code.limits.max_concurrent) == (
        "http://sandbox.invalid/run_code", 3.0, 512, 8)
    assert tools.schemas()[0]["function"]["description"] == "A tool for calculating the reward of gsm8k"
    result = tools.open("t", {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}).call(
        ToolCall("calc_gsm8k_reward", {"answer": "5"}), timeout_s=5)
    assert (result.text, result.reward) == ("Current parsed answer='5' reward=1.0", 0.0)


def test_builtins_without_schema_get_their_default(tmp_path):
    tools = load_tools(write(tmp_path, """
        tools:
          - class_name: lathe.rollout.agent.builtin_tools.CalculatorTool
          - class_name: verl.tools.gsm8k_tool.Gsm8kTool
            config: {type: native}
          - class_name: verl.tools.geo3k_tool.Geo3kTool
            config: {type: native}
        """))
    assert [s["function"]["name"] for s in tools.schemas()] == ["calculator", "calc_gsm8k_reward", "calc_geo3k_reward"]
    assert isinstance(tools.tools["calc_geo3k_reward"], Geo3kTool)
    assert tools.schemas()[2]["function"]["parameters"]["required"] == ["answer"]
    assert tools.schemas()[0]["function"]["parameters"]["required"] == ["expression"]


USER_TOOLS = '''
from lathe.rollout.agent.tools import BaseTool, ToolResponse


class AsyncEcho(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="async:" + parameters["text"]), 0.0, {}


class SyncEcho(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        return "sync:" + parameters["text"] + ":" + self.config["suffix"]


class NoExecute(BaseTool):
    pass


class NotATool:
    pass


class Exploding(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("cannot reach the search service")

    def execute(self, instance_id, parameters, **kwargs):
        return ""
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's tool module, importable as lathe_test_user_tools (and as the file tmp_path/user_tools.py)."""
    (tmp_path / "lathe_test_user_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "lathe_test_user_tools.py"
    sys.modules.pop("lathe_test_user_tools", None)


def test_user_tools_by_module_or_file_path(tmp_path, user_module):
    tools = load_tools(write(tmp_path, f"""
        tools:
          - class_name: lathe_test_user_tools.AsyncEcho
            config: {{type: native}}
            tool_schema: {{type: function, function: {{name: a, parameters: {{type: object}}}}}}
          - class_name: {user_module}:SyncEcho
            config: {{suffix: "!"}}
            tool_schema: {{function: {{name: b}}}}
          - class_name: {user_module}.AsyncEcho
            tool_schema: {{function: {{name: c}}}}
        """))
    s = tools.open("t")
    assert [s.call(ToolCall(n, {"text": "x"}), timeout_s=5).text for n in "abc"] == ["async:x", "sync:x:!", "async:x"]


ENTRY = "{type: function, function: {name: t, parameters: {type: object}}}"


@pytest.mark.parametrize("entries, message", [
    ("[]", r"needs a top-level 'tools:' list"),
    ("\n  - 3", r"tools\[0\]: the entry is a int; write a mapping"),
    (f"\n  - tool_schema: {ENTRY}", r"tools\[0\] \(t\): class_name is missing; set it"),
    (f"\n  - {{class_name: no_such_module_xyz.Tool, tool_schema: {ENTRY}}}",
     (r"tools\[0\] \(t\): class_name no_such_module_xyz.Tool: module no_such_module_xyz cannot be imported .*"
      r"install the package that provides 'no_such_module_xyz'")),
    (f"\n  - {{class_name: lathe_test_user_tools.Missing, tool_schema: {ENTRY}}}",
     r"module lathe_test_user_tools has no 'Missing'; check the class name"),
    (f"\n  - {{class_name: lathe_test_user_tools.NotATool, tool_schema: {ENTRY}}}",
     r"lathe_test_user_tools.NotATool is not a tool class: it needs an execute"),
    (f"\n  - {{class_name: lathe_test_user_tools.NoExecute, tool_schema: {ENTRY}}}", r"is not a tool class"),
    ("\n  - {class_name: lathe_test_user_tools.AsyncEcho}", r"tools\[0\]: tool_schema is missing; add tool_schema:"),
    ("\n  - {class_name: lathe_test_user_tools.AsyncEcho, tool_schema: {function: {description: x}}}",
     r"tool_schema.function.name=None must be a non-empty name"),
    ("\n  - {class_name: lathe_test_user_tools.AsyncEcho, tool_schema: {type: function}}",
     r"tool_schema must be a mapping with a 'function' mapping"),
    ((f"\n  - {{class_name: lathe_test_user_tools.AsyncEcho, tool_schema: {ENTRY}}}"
      f"\n  - {{class_name: lathe_test_user_tools.SyncEcho, tool_schema: {ENTRY}}}"),
     r"tools\[1\] \(t\): the name is already used by tools\[0\]; give each tool its own"),
    (f"\n  - {{class_name: lathe_test_user_tools.AsyncEcho, config: {{type: mcp}}, tool_schema: {ENTRY}}}",
     r"config.type=mcp: MCP tools are not implemented in lathe"),
    (f"\n  - {{class_name: lathe_test_user_tools.AsyncEcho, config: {{type: grpc}}, tool_schema: {ENTRY}}}",
     r"config.type='grpc' is not known; use native"),
    (f"\n  - {{class_name: lathe_test_user_tools.AsyncEcho, config: [1], tool_schema: {ENTRY}}}",
     r"config must be a mapping"),
    (f"\n  - {{class_name: verl.tools.search_tool.SearchTool, tool_schema: {ENTRY}}}",
     r"lathe ships no equivalent of this verl tool .*port it"),
    (f"\n  - {{class_name: lathe_test_user_tools.Exploding, tool_schema: {ENTRY}}}",
     r"tools\[0\] \(t\): Exploding\(config, tool_schema\) failed: RuntimeError: cannot reach the search service"),
    (f"\n  - {{class_name: Tool, tool_schema: {ENTRY}}}", r"write module.Class or path/to/file.py:Class"),
    (f"\n  - {{class_name: nowhere/tools.py:Tool, tool_schema: {ENTRY}}}", r"nowhere/tools.py does not exist"),
])
def test_config_mistakes(tmp_path, user_module, entries, message):
    path = write(tmp_path, f"tools: {entries}\n")
    with pytest.raises(ToolConfigError, match=rf"^{tmp_path}/tools.yaml: .*{message}"):
        load_tools(path)


def test_config_file_mistakes(tmp_path):
    with pytest.raises(ToolConfigError, match=r"missing.yaml: no such tool config file; fix actor_rollout_ref"):
        load_tools(tmp_path / "missing.yaml")
    with pytest.raises(ToolConfigError, match=r"bad.yaml: not a readable YAML file"):
        load_tools(write(tmp_path, "tools: [a: b: c", "bad.yaml"))
    with pytest.raises(ToolConfigError, match=r"none.yaml: needs a top-level 'tools:' list"):
        load_tools(write(tmp_path, "other: 1\n", "none.yaml"))
