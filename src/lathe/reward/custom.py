"""Load a user's reward function from a ``.py`` file (verl's ``custom_reward_function``).

The function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)
        -> float | dict   # a dict carries "score" plus extra numeric metrics

verl users hit "Can't pickle <function compute_score>" when their function must cross a
process boundary, because a module loaded from a path is unknown to the receiving process.
Here the loaded function is wrapped in :class:`RewardFn`, which pickles as
``(path, name, reward_kwargs)`` and re-imports the file on the other side; and the reward
manager's workers are forked, so they inherit the loaded function and pickle nothing.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from lathe.reward.registry import default_compute_score

__all__ = ["RewardFn", "load_reward_fn"]

_FIX_SIGNATURE = "def {name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"


def _module_name(path: Path) -> str:
    """A module name unique to the file, stable across processes (so pickling by name works)."""
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"lathe_custom_reward_{stem}_{digest}"


def _import_file(path: Path) -> ModuleType:
    """Import ``path`` as a fresh module registered in ``sys.modules`` under a unique name."""
    name = _module_name(path)
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ImportError(
            f"reward.custom_reward_function.path={str(path)!r}: importing the file failed{_line_in(exc, path)} with "
            f"{type(exc).__name__}: {exc}; fix the file (run `python {path}` to see the full error)"
        ) from exc
    return module


def _line_in(exc: BaseException, path: Path) -> str:
    """' at line N': the last line of `path` the exception passed through ('' when none, e.g. a SyntaxError, whose
    message has the line)."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename) == path:
            line = frame.lineno
    return f" at line {line}" if line is not None else ""


def _callables_in(module: ModuleType) -> list[str]:
    """Public callables defined in the module itself (imports left out)."""
    return sorted(
        key
        for key, value in vars(module).items()
        if callable(value) and not key.startswith("_") and getattr(value, "__module__", None) == module.__name__
    )


def _find_function(module: ModuleType, name: str, path: Path) -> Callable:
    """Return ``module.<name>``; errors list what the file does define."""
    where = f"reward.custom_reward_function: {str(path)!r}"
    if not hasattr(module, name):
        found = _callables_in(module)
        close = difflib.get_close_matches(name, found, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttributeError(
            f"{where} has no function {name!r}; callables defined there: {found or 'none'}.{hint} "
            f"Set reward.custom_reward_function.name=<one of them>."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{where}: {name!r} is a {type(fn).__name__} ({fn!r:.60}), not a function")
    return fn


def _call_by_keyword(fn: Callable, name: str, path: Path, reward_kwargs: dict) -> bool:
    """How to call ``fn``: True = keywords (as verl does), False = four positionals.

    Raises TypeError when neither form fits the function's signature.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False  # no introspectable signature (C function): call positionally
    try:
        sig.bind(data_source="", solution_str="", ground_truth="", extra_info=None, **reward_kwargs)
        return True
    except TypeError:
        pass
    try:
        sig.bind("", "", "", None, **reward_kwargs)
        return False
    except TypeError as exc:
        kwargs_note = f" with reward_kwargs {sorted(reward_kwargs)}" if reward_kwargs else ""
        raise TypeError(
            f"reward.custom_reward_function: {name}{sig} in {str(path)!r} cannot be called as "
            f"{name}(data_source, solution_str, ground_truth, extra_info){kwargs_note} ({exc}); "
            f"define it as `{_FIX_SIGNATURE.format(name=name)}`"
        ) from None


class RewardFn:
    """A reward function loaded from a file, called with verl's arguments.

    Pickles by reference (path, name, reward_kwargs) and re-imports the file when
    unpickled, so it can be sent to any process that can read the file.
    """

    def __init__(self, path: str | Path, name: str = "compute_score", reward_kwargs: dict | None = None):
        self.path = Path(path).expanduser().resolve()
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "does not exist"
            raise FileNotFoundError(
                f"reward.custom_reward_function.path={str(path)!r} {what} (resolved to {str(self.path)!r}); "
                "pass the path of a .py file that defines the reward function"
            )
        self._fn = _find_function(_import_file(self.path), name, self.path)
        self._by_keyword = _call_by_keyword(self._fn, name, self.path, self.reward_kwargs)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
        if self._by_keyword:
            return self._fn(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
                **self.reward_kwargs,
            )
        return self._fn(data_source, solution_str, ground_truth, extra_info, **self.reward_kwargs)

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"{self.name} from {str(self.path)!r}"


def load_reward_fn(
    path: str | None, name: str = "compute_score", reward_kwargs: dict | None = None
) -> Callable[..., float | dict]:
    """Return ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.

    ``path=None`` gives the built-in dispatcher :func:`default_compute_score` (which takes
    no extra kwargs). Otherwise the function ``name`` is loaded from the file at ``path``
    (``~`` expanded) and ``reward_kwargs`` are passed to it on every call.
    """
    if path is None or str(path).strip() == "":
        if reward_kwargs:
            raise ValueError(
                f"reward_kwargs={reward_kwargs!r} were given but no reward.custom_reward_function.path; "
                "the built-in scorers take no extra arguments: set the path or drop reward_kwargs"
            )
        return default_compute_score
    return RewardFn(path, name, reward_kwargs)
