"""The reward manager's rules, and the keyword arguments the user's reward function gets.

verl passes ``reward_model.reward_kwargs`` to the reward manager it builds: its ``batch`` manager hands them on
to the user's function on every call (as ``custom_reward_function.reward_kwargs`` are), DAPO's reads
``max_resp_len`` and ``overlong_buffer_cfg`` (lathe: ``data.max_response_length`` and
``reward_model.overlong_buffer``, see ``tree.ALIASES``), naive and prime take none. The support registry
refuses the per-row managers' other arguments; here a batch run's two sets of arguments are merged.
"""

from __future__ import annotations

from typing import Any

from .coerce import show
from .errors import ProblemList
from .schema import LatheConfig

PER_ROW_MANAGERS = ("naive", "prime", "dapo", "gdpo")   # lathe.reward.RewardManager: one call per response
BATCH_MANAGER = "batch"                                 # lathe.reward.BatchRewardManager: one call per batch
FN_KWARGS = "reward.reward_kwargs (custom_reward_function.reward_kwargs)"


def is_batch_manager(cfg: LatheConfig) -> bool:
    return cfg.reward_model.reward_manager == BATCH_MANAGER


def reward_fn_kwargs(cfg: LatheConfig) -> dict[str, Any]:
    """The keyword arguments the user's reward function gets on every call: `reward.reward_kwargs`, plus the
    reward manager's `reward_model.reward_kwargs` with the batch manager (`check_reward_manager` refuses a key the
    two give different values)."""
    if is_batch_manager(cfg):
        return {**cfg.reward_model.reward_kwargs, **cfg.reward.reward_kwargs}
    return dict(cfg.reward.reward_kwargs)


def check_reward_manager(cfg: LatheConfig, problems: ProblemList) -> None:
    """The batch manager needs a function file, and its two sets of arguments must agree; the column that is the
    scorer's data_source must be named."""
    if not cfg.data.reward_fn_key.strip():
        problems.add("data.reward_fn_key='' names no column. Fix: set it to the column whose value each row's reward "
                     "function gets as data_source (default: data_source).")
    if not is_batch_manager(cfg):
        return
    if not cfg.reward.custom_reward_function.path:
        problems.add("reward_model.reward_manager=batch calls the user's function once per batch with lists, but "
                     "reward.custom_reward_function.path is not set (the built-in scorers score one response per "
                     "call). Fix: set custom_reward_function.path to a file whose function takes data_sources, "
                     "solution_strs, ground_truths and extra_infos, or set reward_manager=naive.")
    given, own = cfg.reward_model.reward_kwargs, cfg.reward.reward_kwargs
    clashes = sorted(k for k in set(given) & set(own) if given[k] != own[k])
    if clashes:
        both = "; ".join(f"{k}: {show(given[k])} vs {show(own[k])}" for k in clashes)
        problems.add(f"reward_model.reward_kwargs and {FN_KWARGS} give different values for {both}; with "
                     "reward_model.reward_manager=batch both reach the function. Fix: set each argument in one of "
                     "them.")
