"""Cross-field rules for verl V1's trainer modes (`trainer.v1`, `lathe.config.schema_v1`): the ranges of the keys
`colocate_async` reads, and what `colocate_async` does not run beside yet.

`CLASHES` lists each feature `trainer.v1.trainer_mode=colocate_async` refuses, one row each, so a row goes when
`lathe.loop.colocate_async` learns to run beside it. The per-key judgements (no effect, refused) are
`lathe.config.support_v1`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ProblemList
from .plan import is_colocate_async
from .schema import LatheConfig

MODE = "trainer.v1.trainer_mode"
R = "actor_rollout_ref.rollout"


def _agent_loops(cfg: LatheConfig) -> Any:
    return (cfg.actor_rollout_ref.rollout.agent or {}).get("agent_loop_config_path")


# (key, its value in cfg, whether it clashes, what colocate_async does not run beside)
Clash = tuple[str, Callable[[LatheConfig], Any], Callable[[Any], bool], str]
CLASHES: tuple[Clash, ...] = (
    ("rollout.n_gpus_per_node", lambda cfg: cfg.rollout.n_gpus_per_node, lambda v: v > 0,     # plan.is_async
     "a rollout pool of its own (fully-asynchronous training): two asynchronous modes at once"),
    (f"{R}.tensor_model_parallel_size", lambda cfg: cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
     if cfg.actor_rollout_ref.rollout.multi_turn.enable or _agent_loops(cfg) else 1, lambda v: v > 1,
     "agent loops (multi_turn.enable, agent.agent_loop_config_path) on tensor-parallel engine replicas (there the "
     "replica's leader runs the loop and its ranks follow its steps; colocate_async's ranks each take the requests)"),
    (f"{R}.data_parallel_size", lambda cfg: cfg.actor_rollout_ref.rollout.data_parallel_size, lambda v: v > 1,
     "data-parallel attention engines (their replicas step in lockstep, whatever each has to do)"),
    ("algorithm.filter_groups.enable", lambda cfg: cfg.algorithm.filter_groups.enable and cfg.reward_model.enable,
     bool, "DAPO's dynamic sampling with a learned reward model (reward_model.enable: colocate_async filters each "
     "group by its scores as it finishes, the reward model scores a step's groups just before its update)"),
    ("reward_model.launch_reward_fn_async", lambda cfg: cfg.reward_model.launch_reward_fn_async, bool,
     "scoring in the background (colocate_async scores each group as it finishes)"),
    ("algorithm.adv_estimator", lambda cfg: cfg.algorithm.adv_estimator if cfg.reward_model.enable else None,
     lambda v: v == "remax", "ReMax's greedy baselines with a learned reward model (reward_model.enable: the "
     "baselines are scored by rule as each greedy response finishes, as in fully-asynchronous training)"),
)


def colocate_async_problems(cfg: LatheConfig) -> list[str]:
    """What `trainer.v1.trainer_mode=colocate_async` does not run beside (yet), each naming both keys and the fix."""
    if not is_colocate_async(cfg):
        return []
    out = []
    for key, read, clashes, what in CLASHES:
        value = read(cfg)
        if clashes(value):
            out.append(f"{MODE}=colocate_async with {key}={_shown(value)}: colocate_async beside {what} is not "
                       f"implemented yet in lathe. Fix: train with {MODE}=sync, or remove {key}.")
    return out


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def range_problems(cfg: LatheConfig) -> list[str]:
    """The V1 counts colocate_async reads, each within its range (refused in any mode: verl's would fail too)."""
    v1 = cfg.trainer.v1
    warmup, threshold = v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold
    out = []
    if warmup < 0:
        out.append(f"trainer.v1.colocate_async.num_warmup_batches={warmup} is out of range: it counts the training "
                   "batches of prompts issued ahead of the first step, so it must be >= 0 (0 = the synchronous "
                   "loop's samples). Fix: set it to 0 or more.")
    if threshold <= 0:
        out.append(f"trainer.v1.sampler.max_off_policy_threshold={threshold} is out of range: it counts the steps "
                   "(model versions) from a prompt's issue to its training, so it must be > 0. Fix: set it to 1 or "
                   "more (verl's default is 8).")
    return out


def check_v1(cfg: LatheConfig, problems: ProblemList) -> None:
    """Add the V1 trainer's range and colocate_async problems to `problems`."""
    for message in range_problems(cfg) + colocate_async_problems(cfg):
        problems.add(message)

