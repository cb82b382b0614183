"""verl's V1 trainer keys (`trainer.use_v1`, `trainer.v1.*`): which ones act in lathe and how they are judged.

verl's V1 trainer (its default, `trainer.use_v1=true`) runs in one of three modes, `trainer.v1.trainer_mode`:
`sync` (lathe's synchronous loop), `colocate_async` (`lathe.loop.colocate_async`: the rollout on the trainer's
devices runs ahead of it and continues unfinished responses across steps) and `separate_async` (standalone rollout
devices: lathe runs that as fully-asynchronous training, with verl's fully_async_policy keys, and refuses the mode
naming them). lathe keeps these keys where it keeps every verl key it has no field for (`cfg.verl_keys`, judged by
`support_verl`'s patterns); `v1_settings` reads them, at verl's defaults where unset. With `trainer.use_v1=false`
(verl's legacy trainer, which lathe's synchronous loop also is) no V1 key is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ProblemList
from .plan import is_async

MODES = ("sync", "colocate_async", "separate_async")
STRATEGIES = ("drop", "wait")
V1 = "trainer.v1"
SAMPLER = f"{V1}.sampler"


@dataclass(frozen=True)
class V1Settings:
    """The V1 keys lathe acts on, at verl's defaults where unset."""

    use_v1: bool = True
    trainer_mode: str = "sync"                # as given (`mode` says which one runs)
    num_warmup_batches: int = 1               # trainer.v1.colocate_async.num_warmup_batches
    max_off_policy_threshold: int = 8         # trainer.v1.sampler.*
    max_off_policy_strategy: str = "drop"

    @property
    def mode(self) -> str:
        """The mode that runs: `trainer_mode` under the V1 trainer, `sync` under verl's legacy one."""
        return self.trainer_mode if self.use_v1 else "sync"


def v1_settings(cfg: Any) -> V1Settings:
    held, d = cfg.verl_keys, V1Settings()
    return V1Settings(use_v1=held.get("trainer.use_v1", d.use_v1) is not False,
                      trainer_mode=str(held.get(f"{V1}.trainer_mode", d.trainer_mode)),
                      num_warmup_batches=held.get(f"{V1}.colocate_async.num_warmup_batches", d.num_warmup_batches),
                      max_off_policy_threshold=held.get(f"{SAMPLER}.max_off_policy_threshold",
                                                        d.max_off_policy_threshold),
                      max_off_policy_strategy=str(held.get(f"{SAMPLER}.max_off_policy_strategy",
                                                           d.max_off_policy_strategy)))


def is_colocate_async(cfg: Any) -> bool:
    """verl V1's `trainer.v1.trainer_mode=colocate_async` runs (`lathe.loop.colocate_async`)."""
    return v1_settings(cfg).mode == "colocate_async"


# -- judges of `support_verl._runs`' V1 patterns: (kind, message) or None -------------------------------------
def judge_trainer_mode(value: Any, cfg: Any) -> tuple[str, str] | None:
    s = v1_settings(cfg)
    if value not in MODES:
        return "refuse", (f"`{V1}.trainer_mode`={value!r} is not one of verl's modes. Fix: set it to "
                          f"{', '.join(MODES)}.")
    if value != "sync" and not s.use_v1:
        return "warn", (f"`{V1}.trainer_mode`={value} has no effect in lathe: trainer.use_v1=false runs verl's "
                        "legacy trainer (lathe's synchronous loop), which reads no trainer.v1 key.")
    if value != "separate_async":
        return None
    sync_step = cfg.verl_keys.get(f"{V1}.separate_async.parameter_sync_step", 4)
    warmup = cfg.verl_keys.get(f"{V1}.separate_async.num_warmup_batches", 1)
    return "refuse", (
        f"`{V1}.trainer_mode`=separate_async: verl V1's standalone rollout devices run in lathe as fully-asynchronous "
        f"training, with verl's fully_async_policy keys. Fix: set rollout.nnodes and rollout.n_gpus_per_node (the "
        f"standalone rollout's devices, which verl V1 sets as actor_rollout_ref.rollout.nnodes / n_gpus_per_node), "
        f"async_training.trigger_parameter_sync_step={sync_step} (its parameter_sync_step), "
        f"async_training.require_batches=1, async_training.staleness_threshold={warmup} (its num_warmup_batches), "
        f"async_training.partial_rollout=true, and remove {V1}.trainer_mode; a fully-async step is one "
        f"ppo_mini_batch_size update where verl V1 counts parameter_sync_step={sync_step} of them as one step, so "
        f"scale trainer.total_training_steps, save_freq and test_freq by {sync_step} (docs/fully_async.md).")


def _colocated_only(key: str, check, need: str):
    """A key read only by colocate_async: checked there (`check(value)`, `need` says what it must be), no effect
    elsewhere (verl's synchronous sampling does not read it either)."""
    def judge(value: Any, cfg: Any) -> tuple[str, str] | None:
        if not check(value):
            return "refuse", f"`{key}`={value!r} must be {need}. Fix: set it so, or remove it."
        if is_colocate_async(cfg) or value == getattr(V1Settings(), key.rsplit(".", 1)[1]):
            return None
        return "warn", (f"`{key}`={value} has no effect in lathe: it is read only with {V1}.trainer_mode="
                        "colocate_async (verl's synchronous V1 trainer does not read it either).")
    return judge


judge_warmup = _colocated_only(f"{V1}.colocate_async.num_warmup_batches",
                               lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                               "an integer >= 0 (training batches of prompts issued ahead of the first step)")
judge_threshold = _colocated_only(f"{SAMPLER}.max_off_policy_threshold",
                                  lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                                  "an integer > 0 (steps from a prompt's issue to its training)")
judge_strategy = _colocated_only(f"{SAMPLER}.max_off_policy_strategy", lambda v: v in STRATEGIES,
                                 "drop or wait")


def colocate_async_problems(cfg: Any) -> list[str]:
    """What `trainer.v1.trainer_mode=colocate_async` does not run beside (yet), each naming both keys and the fix."""
    if not is_colocate_async(cfg):
        return []
    ro, fix = cfg.actor_rollout_ref.rollout, f"train with {V1}.trainer_mode=sync, or remove"
    clashes = [
        (is_async(cfg), "rollout.n_gpus_per_node", cfg.rollout.n_gpus_per_node,
         "a rollout pool of its own (fully-asynchronous training): two asynchronous modes at once"),
        (ro.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable", "true",
         "multi-turn agent loops (their trajectories are not streamed across steps yet)"),
        (bool((ro.agent or {}).get("agent_loop_config_path")), "actor_rollout_ref.rollout.agent.agent_loop_config_path",
         (ro.agent or {}).get("agent_loop_config_path"), "custom agent loops (not streamed across steps yet)"),
        (ro.tensor_model_parallel_size > 1, "actor_rollout_ref.rollout.tensor_model_parallel_size",
         ro.tensor_model_parallel_size, "tensor-parallel engine replicas (each replica streams on one rank)"),
        (ro.data_parallel_size > 1, "actor_rollout_ref.rollout.data_parallel_size", ro.data_parallel_size,
         "data-parallel attention engines (each replica streams on one rank)"),
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable", "true",
         "DAPO's dynamic sampling (its rounds are the synchronous loop's)"),
        (cfg.reward_model.launch_reward_fn_async, "reward_model.launch_reward_fn_async", "true",
         "scoring in the background (colocate_async scores each group as it finishes)")]
    return [f"{V1}.trainer_mode=colocate_async with {key}={value}: {why} is not implemented yet in lathe. Fix: {fix} "
            f"{key}." for clash, key, value, why in clashes if clash]


def check_v1(cfg: Any, problems: ProblemList) -> None:
    for message in colocate_async_problems(cfg):
        problems.add(message)
