"""Load a user's reward function from a ``.py`` file (verl's ``custom_reward_function``).

The function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)
        -> float | dict   # a dict carries "score" plus extra numeric metrics

verl users hit "Can't pickle <function compute_score>" when their function must cross a
process boundary, because a module loaded from a path is unknown to the receiving process.
Here the loaded function is wrapped in :class:`RewardFn`, which pickles as
``(path, name, reward_kwargs, batch)`` and re-imports the file on the other side; and the reward
managers' workers are forked, so they inherit the loaded function and pickle nothing.

With ``batch=True`` (verl's ``batch`` reward manager, :mod:`lathe.reward.batch`) the function scores a
whole batch in one call, by keyword, and returns one result per row::

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)
        -> list[float | dict]
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
_FIX_BATCH = "def {name}(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)"
_ROW_ARGS = {"data_source": "", "solution_str": "", "ground_truth": "", "extra_info": None}
_BATCH_ARGS = {"data_sources": [], "solution_strs": [], "ground_truths": [], "extra_infos": []}


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


def _binds(sig: inspect.Signature, *args, **kwargs) -> bool:
    try:
        sig.bind(*args, **kwargs)
        return True
    except TypeError:
        return False


def _named(sig: inspect.Signature, args: dict) -> bool:
    """The function names its first parameters as one of the managers passes them (per row or as lists)."""
    return list(sig.parameters)[:2] == list(args)[:2]


def _call_by_keyword(fn: Callable, name: str, path: Path, reward_kwargs: dict, batch: bool = False) -> bool:
    """How to call ``fn``: True = keywords (as verl does), False = four positionals. A batch function is called by
    keyword only (verl's batch manager does).

    Raises TypeError when neither form fits the function's signature.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return batch  # no introspectable signature (C function): call positionally (a batch one by keyword)
    if batch:
        if _binds(sig, **_BATCH_ARGS, **reward_kwargs):
            return True
        per_row = _binds(sig, **_ROW_ARGS, **reward_kwargs) or _binds(sig, *_ROW_ARGS.values(), **reward_kwargs)
        raise TypeError(_bad_signature(name, sig, path, reward_kwargs, batch=True,
                                       other_fits=per_row or _named(sig, _ROW_ARGS)))
    if _binds(sig, **_ROW_ARGS, **reward_kwargs):
        return True
    # verl's names for lists: a batch function (which four positionals would bind, wrongly)
    batch_fits = _binds(sig, **_BATCH_ARGS, **reward_kwargs) or _named(sig, _BATCH_ARGS)
    if not batch_fits and _binds(sig, *_ROW_ARGS.values(), **reward_kwargs):
        return False
    raise TypeError(_bad_signature(name, sig, path, reward_kwargs, batch=False, other_fits=batch_fits))


def _bad_signature(name: str, sig: inspect.Signature, path: Path, reward_kwargs: dict, *, batch: bool,
                   other_fits: bool) -> str:
    """Why `name` cannot be called as the reward manager calls it, and the fix (the other manager when its form
    fits)."""
    kwargs_note = f" with reward_kwargs {sorted(reward_kwargs)}" if reward_kwargs else ""
    if batch:
        call = f"{name}(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=...)"
        how = "as reward_model.reward_manager=batch calls it, once per batch"
        fix = ("it scores one response per call: set reward_model.reward_manager=naive" if other_fits else
               f"define it as `{_FIX_BATCH.format(name=name)}` returning one score per row")
    else:
        call = f"{name}(data_source, solution_str, ground_truth, extra_info)"
        how = "once per response"
        fix = ("it takes lists (a whole batch): set reward_model.reward_manager=batch" if other_fits else
               f"define it as `{_FIX_SIGNATURE.format(name=name)}`")
    return (f"reward.custom_reward_function: {name}{sig} in {str(path)!r} cannot be called as {call}{kwargs_note} "
            f"({how}); {fix}")


class RewardFn:
    """A reward function loaded from a file, called with verl's arguments (``batch``: its batch manager's lists).

    Pickles by reference (path, name, reward_kwargs, batch) and re-imports the file when
    unpickled, so it can be sent to any process that can read the file.
    """

    def __init__(self, path: str | Path, name: str = "compute_score", reward_kwargs: dict | None = None,
                 batch: bool = False):
        self.path = Path(path).expanduser().resolve()
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.batch = bool(batch)
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "does not exist"
            raise FileNotFoundError(
                f"reward.custom_reward_function.path={str(path)!r} {what} (resolved to {str(self.path)!r}); "
                "pass the path of a .py file that defines the reward function"
            )
        self._fn = _find_function(_import_file(self.path), name, self.path)
        self._by_keyword = _call_by_keyword(self._fn, name, self.path, self.reward_kwargs, self.batch)

    def __call__(self, *args, **kwargs):
        """Per row: ``(data_source, solution_str, ground_truth, extra_info=None)``; batch: ``(data_sources=...,
        solution_strs=..., ground_truths=..., extra_infos=...)``. The reward kwargs are added."""
        if self.batch:
            return self._fn(*args, **kwargs, **self.reward_kwargs)
        return self._call_row(*args, **kwargs)

    def _call_row(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
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
        return {"path": str(self.path), "name": self.name, "reward_kwargs": self.reward_kwargs, "batch": self.batch}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"{self.name} from {str(self.path)!r}"


def load_reward_fn(
    path: str | None, name: str = "compute_score", reward_kwargs: dict | None = None, batch: bool = False
) -> Callable[..., float | dict]:
    """Return ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.

    ``path=None`` gives the built-in dispatcher :func:`default_compute_score` (which takes
    no extra kwargs). Otherwise the function ``name`` is loaded from the file at ``path``
    (``~`` expanded) and ``reward_kwargs`` are passed to it on every call. ``batch``: the function
    scores a whole batch (verl's ``batch`` reward manager; see :class:`RewardFn`), which needs a file.
    """
    if path is None or str(path).strip() == "":
        if batch:
            raise ValueError(
                "reward_model.reward_manager=batch calls the user's function once per batch, but "
                "reward.custom_reward_function.path is not set and the built-in scorers score one response at a "
                "time: set the path to a file whose function takes lists, or set reward_manager=naive"
            )
        if reward_kwargs:
            raise ValueError(
                f"reward_kwargs={reward_kwargs!r} were given but no reward.custom_reward_function.path; "
                "the built-in scorers take no extra arguments: set the path or drop reward_kwargs"
            )
        return default_compute_score
    return RewardFn(path, name, reward_kwargs, batch)
