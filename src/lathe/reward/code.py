"""Code tasks (verl's `codecontests`, `apps`, `codeforces`, `taco`): the response's program runs on each test in the
local sandbox (`lathe.reward.sandbox`); the score is 1.0 when every test passes, else 0.0.

Ground truth (verl's schema): JSON `{"inputs": [...], "outputs": [...]}`, optionally with `fn_name`. Without it
each input is the program's stdin and the output its expected stdout (compared line by line, trailing
whitespace ignored). With it the program defines that function; each input is a JSON list of arguments and the
output the JSON value it must return. The program is the last ```python fenced block of the response (or the
whole response when it has none). Tests stop at the first failure. Each test may take the sandbox's time
limit, and the reward manager's `reward.timeout_s` bounds the whole sample: raise it for tasks with many tests.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lathe.reward.sandbox import run_python

CODE_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_HARNESS = """

import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = {fn!r}
_target = globals().get(_fn) or getattr(globals().get("Solution", object)(), _fn, None)
print(_json.dumps(_target(*_args)))
"""


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


def parse_tests(ground_truth: Any) -> dict:
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) \
            or not isinstance(tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError("a code task's ground truth must be JSON {\"inputs\": [...], \"outputs\": [...]} with as "
                         "many outputs as inputs (optional \"fn_name\")")
    return tests


def same_output(got: str, expected: Any) -> bool:
    expected = expected if isinstance(expected, str) else "\n".join(map(str, expected)) \
        if isinstance(expected, list) else str(expected)
    lines = lambda text: [line.rstrip() for line in text.strip().splitlines()]   # noqa: E731
    return lines(got) == lines(expected)


def compute_score(solution_str: str, ground_truth: Any) -> float:
    tests = parse_tests(ground_truth)
    code = extract_code(solution_str)
    if not code:
        return 0.0
    fn = tests.get("fn_name")
    for given, expected in zip(tests["inputs"], tests["outputs"]):
        if fn:
            args = given if isinstance(given, list) else json.loads(given)
            run = run_python(code + _HARNESS.format(fn=fn), json.dumps(args))
            try:
                ok = run.status == "ok" and json.loads(run.stdout.strip().splitlines()[-1]) == expected
            except (ValueError, IndexError):
                ok = False
        else:
            run = run_python(code, given if isinstance(given, str) else str(given))
            ok = run.status == "ok" and same_output(run.stdout, expected)
        if not ok:
            return 0.0
    return 1.0
