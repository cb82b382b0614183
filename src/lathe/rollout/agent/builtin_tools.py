"""lathe's built-in tools, and what a tool config's ``class_name`` names.

* `Gsm8kTool` (``calc_gsm8k_reward``): verl's GSM8K demo tool, same behaviour: the model submits an answer and
  reads its score; the step reward is 0.0 when the score beats the previous submission's, else -0.05.
* `Geo3kTool` (``calc_geo3k_reward``): verl's Geometry3K demo tool, the same exchange scored by lathe's geo3k
  scorer (the answer alone, no format part).
  Unlike verl's, both refuse a trajectory whose row has no ground truth (an error answer the model reads, naming the
  `lathe preprocess` command that writes it) instead of scoring every submission 0.
* `SecretLookupTool` (``f``): the built-in agent task's lookup (`lathe.data.secret_lookup`); its verdict is
  whether the trajectory looked its secret up.
* `CalculatorTool` (``calculator``): arithmetic, evaluated from the `ast` (no names, calls or attributes) with
  the sizes of results bounded, so ``9**9**9`` is refused instead of hanging.
* `CodeInterpreterTool` (``code_interpreter``): runs Python in lathe's sandbox (`lathe.reward.sandbox`), or on
  a SandboxFusion service; it stands in for verl's ``SandboxFusionTool`` and reads its config keys.

`resolve_tool_class` maps verl's class paths of these tools to lathe's, so a verl tool config runs unchanged.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import operator
import sys
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import uuid4

from lathe.data.secret_lookup import TOOL_NAME
from lathe.reward.geo3k import compute_score as geo3k_score
from lathe.reward.gsm8k import compute_score
from lathe.reward.sandbox import RunResult, SandboxLimits, run_python, unavailable
from lathe.rollout.agent.tools import BaseTool, ToolConfigError, ToolResponse

__all__ = ["VERL_BUILTINS", "CalculatorTool", "CodeInterpreterTool", "Geo3kTool", "Gsm8kTool", "SecretLookupTool",
           "evaluate_arithmetic", "resolve_tool_class"]

# verl class paths that lathe runs with its own built-ins.
VERL_BUILTINS = {"verl.tools.gsm8k_tool.Gsm8kTool": "Gsm8kTool",
                 "verl.tools.geo3k_tool.Geo3kTool": "Geo3kTool",
                 "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "CodeInterpreterTool"}


def _function_schema(name: str, description: str, parameter: str, about: str) -> dict:
    """An OpenAI function schema with one required string parameter."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {"type": "string", "description": about}},
                       "required": [parameter]}}}


class _AnswerCheckTool(BaseTool):
    """verl's answer-checking demo tools: `create(ground_truth=...)` stores a trajectory's answer; each
    `execute({"answer": ...})` scores the submission (`_score`), answers "Current parsed answer=... reward=...",
    and returns verl's step reward: 0.0 when the score beats the previous submission's, else STEP_PENALTY;
    `calc_reward` is the latest submission's score."""

    STEP_PENALTY = -0.05                # verl's step reward for a submission that does not beat the previous one

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    PREPROCESS = ""                     # the `lathe preprocess` command that writes this tool's tools_kwargs

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs):
        """A trajectory's instance; one without a ground truth is refused (the model reads the error, and
        `agent/tool_errors/mean` counts it), instead of every submission scoring 0."""
        instance_id = instance_id or uuid4().hex
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"{self.name} has no ground truth for this trajectory: its data row lacks "
                             f"extra_info.tools_kwargs.{self.name}.create_kwargs.ground_truth; make the data with "
                             f"`lathe preprocess {self.PREPROCESS}`")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        state = self._instances[instance_id]
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state["response"] = self._response(answer)
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else self.STEP_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward!r}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return self._score(state["response"], state["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)

    def _response(self, answer: str) -> str:
        """The text the scorer reads for a submitted answer."""
        return answer

    def _score(self, response: str, ground_truth: Any) -> float:
        raise NotImplementedError


class Gsm8kTool(_AnswerCheckTool):
    """verl's ``calc_gsm8k_reward``: `create(ground_truth=...)` stores the answer; `execute({"answer": ...})`
    scores ``"#### " + answer`` (lathe's GSM8K scorer, flexible); `calc_reward` is the latest score."""

    PREPROCESS = "gsm8k_tool"

    @classmethod
    def default_schema(cls) -> dict:
        return _function_schema("calc_gsm8k_reward", "Submit an answer to the GSM8K question and get its score "
                                "(1.0 when it is right)", "answer", "the final answer, a number")

    def _response(self, answer: str) -> str:
        return answer if answer.startswith("#### ") else "#### " + answer

    def _score(self, response: str, ground_truth: Any) -> float:
        return compute_score(response, ground_truth, method="flexible")


class Geo3kTool(_AnswerCheckTool):
    """verl's ``calc_geo3k_reward``: `create(ground_truth=...)` stores the answer; `execute({"answer": ...})` scores
    the submission with lathe's geo3k scorer, accuracy only (verl's ``format_score=0.0``): 1.0 when it equals the
    ground truth (math-verify: ``3`` = ``3.0``, ``\\frac{1}{2}`` = ``0.5``), else 0.0. verl compares the whole
    submission (``use_boxed=False``); lathe does too, unless it holds a ``\\boxed{}``, whose content is compared
    (the schema asks for the answer in a box). `calc_reward` is the latest score."""

    PREPROCESS = "geo3k_tool"

    @classmethod
    def default_schema(cls) -> dict:
        return _function_schema("calc_geo3k_reward", "Submit an answer to the geometry question and get its score "
                                "(1.0 when it is right)", "answer", "the final answer, enclosed in \\boxed{}")

    def _score(self, response: str, ground_truth: Any) -> float:
        boxed = "\\boxed" in response or "\\fbox" in response
        return geo3k_score(response, ground_truth, use_boxed=boxed, format_score=0.0)


class SecretLookupTool(BaseTool):
    """``f()``, the tool of the built-in agent task (`lathe.data.secret_lookup`, tool config
    ``builtin:secret_lookup``): answers the secret digit its trajectory was created with (``create_kwargs.secret``);
    `calc_reward` is its verdict: 1.0 once the trajectory has looked the secret up, else 0.0."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    @classmethod
    def default_schema(cls) -> dict:
        return {"type": "function", "function": {"name": TOOL_NAME, "description": "the secret digit of this item",
                                                 "parameters": {"type": "object", "properties": {}, "required": []}}}

    def create(self, instance_id: str | None = None, secret: str | None = None, **kwargs):
        if secret is None:
            raise ValueError(f"{self.name} has no secret for this trajectory: its data row lacks extra_info."
                             f"tools_kwargs.{self.name}.create_kwargs.secret (builtin:secret_lookup rows have it)")
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = {"secret": str(secret), "looked_up": False}
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        state = self._instances[instance_id]
        state["looked_up"] = True
        return ToolResponse(text=state["secret"]), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return float(self._instances[instance_id]["looked_up"])

    def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096                     # about 1233 digits: any integer result stays small and prints fast
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, + - * / // % ** and parentheses"


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError (a message for the model) for anything else."""
    text = str(expression).strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has more than {MAX_EXPRESSION_CHARS} characters; split the calculation")
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"{text[:60]!r} is not an arithmetic expression ({e.msg}); use {_ALLOWED}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except (OverflowError, MemoryError, RecursionError):
        raise ValueError("the result is too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large (not a finite number)")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return value
    raise ValueError(_refusal(node))


def _check_size(op: ast.operator, left: float, right: float) -> None:
    """Refuse integer products and powers whose result would pass MAX_INT_BITS (before computing them)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return                           # float arithmetic is bounded; overflow raises OverflowError
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise OverflowError
    if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise OverflowError


def _refusal(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names like {node.id!r} are not allowed; use {_ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; use {_ALLOWED}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "'^' is not a power here; write ** (2**10)"
    return f"{type(node).__name__} is not allowed; use {_ALLOWED}"


def _format_number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.15g}"


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the value of an arithmetic expression, as text."""

    @classmethod
    def default_schema(cls) -> dict:
        return _function_schema("calculator", f"Evaluate an arithmetic expression ({_ALLOWED})", "expression",
                                "the expression, e.g. (3 + 4) * 12 / 7")

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        if "expression" not in parameters:
            raise KeyError("expression")
        return ToolResponse(text=_format_number(evaluate_arithmetic(parameters["expression"]))), 0.0, {}


class CodeInterpreterTool(BaseTool):
    """``code_interpreter(code)``: runs a Python program in the sandbox; answers its output (stdout, plus stderr
    when it fails, and a note when it timed out), cut to ``max_output_chars``.

    Config (verl's SandboxFusionTool keys): ``sandbox_fusion_url`` (a SandboxFusion run_code endpoint; default:
    the local bubblewrap sandbox), ``default_timeout`` (seconds, default 10; verl's is 30), ``memory_limit_mb``
    (1024), ``rate_limit`` (runs at once on this machine, 4), ``max_output_chars`` (4096). Without a URL the local
    sandbox is checked when the tool is built: a machine that cannot run it fails at load time, not at every call.
    Keep ``default_timeout`` below ``multi_turn.tool_timeout``, or the session gives up before the sandbox does.
    """

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        c = self.config
        if c.get("default_language", "python") != "python":
            raise ToolConfigError(f"config.default_language={c['default_language']!r}: the code interpreter runs "
                                  f"python only")
        self.limits = SandboxLimits(time_limit_s=float(c.get("default_timeout", 10.0)),
                                    memory_limit_mb=int(c.get("memory_limit_mb", 1024)),
                                    max_concurrent=int(c.get("rate_limit", 4)), url=c.get("sandbox_fusion_url") or None)
        self.max_output_chars = int(c.get("max_output_chars", 4096))
        if self.limits.url is None and (reason := unavailable()):
            raise ToolConfigError(f"the code interpreter's local sandbox cannot run here: {reason}; or set "
                                  f"config.sandbox_fusion_url to a SandboxFusion run_code endpoint")

    @classmethod
    def default_schema(cls) -> dict:
        return _function_schema("code_interpreter", "Run a Python program and read what it prints", "code",
                                "the Python source; print() the values you want to see")

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        code = parameters["code"]
        if not isinstance(code, str):
            raise TypeError("code must be a string of Python source")
        limits, timeout = self.limits, parameters.get("timeout")
        if isinstance(timeout, (int, float)) and 0 < timeout < limits.time_limit_s:
            limits = replace(limits, time_limit_s=float(timeout))
        run = run_python(code, limits=limits)
        return ToolResponse(text=self._answer(run, limits)), 0.0, {"status": run.status}

    def _answer(self, run: RunResult, limits: SandboxLimits) -> str:
        parts = [run.stdout.rstrip("\n")]
        if run.status != "ok":
            parts.append(run.stderr.rstrip("\n"))
        parts.append({"timeout": f"[timed out after {limits.time_limit_s:g} s]",
                      "output_limit": "[stopped: the output limit was reached]",
                      "error": f"[exit status {run.returncode}]" if not run.stderr.strip() else ""}.get(run.status, ""))
        text = "\n".join(p for p in parts if p) or "(no output; print() the values you want to see)"
        if len(text) <= self.max_output_chars:
            return text
        half = self.max_output_chars // 2
        return f"{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}"


def resolve_tool_class(class_name: str) -> Any:
    """What a tool config's `class_name` names: verl's built-ins mapped to lathe's, ``module.Class``,
    ``pkg.mod:Class``, or a file: ``path/to/file.py:Class`` or ``path/to/file.py.Class`` (relative to the working
    directory). ValueError says what to install or check."""
    if class_name in VERL_BUILTINS:
        return globals()[VERL_BUILTINS[class_name]]
    if class_name.startswith("verl."):
        raise ValueError(f"class_name {class_name}: lathe ships no equivalent of this verl tool (it runs "
                         f"{', '.join(VERL_BUILTINS)}); port it: copy the class into your own module, import "
                         f"BaseTool and ToolResponse from lathe.rollout.agent.tools, and name that class here")
    module_name, sep, attr = class_name.rpartition(":")
    if not sep:
        module_name, _, attr = class_name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"class_name {class_name!r}: write module.Class or path/to/file.py:Class")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"class_name {class_name}: module {module_name} cannot be imported ({e}); install the "
                         f"package that provides {e.name!r}, or add its directory to PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - a broken user module is a config error
        raise ValueError(f"class_name {class_name}: importing {module_name} failed: {type(e).__name__}: "
                         f"{str(e)[:300]}") from None
    if not hasattr(module, attr):
        raise ValueError(f"class_name {class_name}: module {module_name} has no {attr!r}; check the class name")
    return getattr(module, attr)


def _import_file(path_text: str) -> Any:
    """Import a ``.py`` file as a module of its own (once per file)."""
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ValueError(f"file {path} does not exist")
    name = f"lathe_user_tool_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
