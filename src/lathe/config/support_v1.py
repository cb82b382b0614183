"""The registry's entries for verl V1's trainer keys (`trainer.v1`, `lathe.config.schema_v1`).

`trainer.v1.trainer_mode` acts (`plan.trainer_mode`: sync is lathe's synchronous loop, colocate_async
`lathe.loop.colocate_async`); separate_async is refused, naming the fully-asynchronous keys that run it with the
values of the user's config. colocate_async's own keys act in that mode and have no effect in the others; a custom
replay buffer is refused; the separate_async group has no effect (that mode is refused). With `trainer.use_v1=false`
(verl's legacy trainer: lathe's synchronous loop) every `trainer.v1` key set has no effect. The counts' ranges and
what colocate_async does not run beside are `rules_v1`'s (cross-field rules).
"""

from __future__ import annotations

from dataclasses import is_dataclass, replace
from typing import Any

from .coerce import show
from .plan import trainer_mode
from .schema_v1 import SeparateAsyncConfig
from .support_base import Entry, default_of, inert, is_off, no_entries, only_on, refuse, warn
from .tree import all_paths, get_path

V1 = "trainer.v1"
LEGACY = ("it is read only with trainer.use_v1=true (trainer.use_v1=false runs verl's legacy trainer, lathe's "
          "synchronous loop, which reads no trainer.v1 key)")
COLOCATED = f"it is read only with {V1}.trainer_mode=colocate_async"
SEPARATE = (f"it is read only with {V1}.trainer_mode=separate_async, which lathe refuses (it runs as "
            "fully-asynchronous training)")
REPLAY_BUFFER = "a custom replay buffer (verl's ReplayBuffer subclass over its TransferQueue)"


def _under_v1(entry: Entry) -> Entry:
    """`entry`, except that with trainer.use_v1=false a value set has no effect (verl's legacy trainer)."""
    own = replace(entry, when="")

    def judge(value: Any, cfg: Any) -> tuple[str, str] | None:
        default = default_of(entry.key)
        if cfg.trainer.use_v1:
            return own.verdict(value, default, cfg)
        if is_off(value, default):
            return None
        return "warn", f"`{entry.key}`={show(value)} has no effect in lathe: {LEGACY}."
    return replace(entry, judge=judge)


def _rollout_devices(cfg: Any) -> str:
    """The rollout pool's keys, with verl V1's standalone rollout devices when the config gives them."""
    ro = cfg.actor_rollout_ref.rollout
    where = "the standalone rollout's devices, which verl V1 sets as actor_rollout_ref.rollout.nnodes / n_gpus_per_node"
    if ro.nnodes > 0 and ro.n_gpus_per_node:
        return f"rollout.nnodes={ro.nnodes} and rollout.n_gpus_per_node={ro.n_gpus_per_node} ({where})"
    return f"rollout.nnodes and rollout.n_gpus_per_node ({where})"


def _scaled(cfg: Any, factor: int) -> str:
    """trainer.total_training_steps, save_freq and test_freq, each with its value x `factor` when it is set."""
    t = cfg.trainer
    counts = {"total_training_steps": t.total_training_steps, "save_freq": t.save_freq, "test_freq": t.test_freq}
    shown = [f"trainer.{k}={v * factor}" if v is not None and v > 0 else f"trainer.{k}" for k, v in counts.items()]
    return f"{shown[0]}, {shown[1]} and {shown[2]}"


def separate_async_message(cfg: Any) -> str:
    """The refusal of trainer_mode=separate_async, with the fully-async keys (and the user's values) that run it."""
    sa = cfg.trainer.v1.separate_async
    sync_step, warmup = sa.parameter_sync_step, sa.num_warmup_batches
    return (f"`{V1}.trainer_mode`=separate_async: verl's separate-pool V1 trainer runs in lathe as fully-asynchronous "
            f"training (verl's fully_async_policy keys). Fix: set {_rollout_devices(cfg)}, "
            f"async_training.trigger_parameter_sync_step={sync_step} (its {V1}.separate_async.parameter_sync_step), "
            f"async_training.require_batches=1, async_training.staleness_threshold={warmup} (its "
            f"{V1}.separate_async.num_warmup_batches), and remove {V1}.trainer_mode. lathe's fully-async step is one "
            f"mini-batch update where verl V1 counts parameter_sync_step={sync_step} of them as one step, so scale "
            f"the step counts by {sync_step}: {_scaled(cfg, sync_step)}.")


def _separate_async(value: Any, cfg: Any) -> tuple[str, str] | None:
    return ("refuse", separate_async_message(cfg)) if value == "separate_async" else None


def _mode() -> Entry:
    entry = refuse(f"{V1}.trainer_mode", "separate_async, verl's separate-pool V1 trainer (lathe runs it as "
                   "fully-asynchronous training, with verl's fully_async_policy keys; sync and colocate_async act)",
                   "set rollout.nnodes and rollout.n_gpus_per_node, async_training.trigger_parameter_sync_step="
                   "<parameter_sync_step>, async_training.require_batches=1, async_training.staleness_threshold="
                   "<num_warmup_batches>, and remove it")
    return only_on("separate_async or use_v1=false", replace(entry, judge=_separate_async))


def _colocated(key: str, also: str = "") -> Entry:
    """A key colocate_async reads: no effect in the other modes."""
    return only_on("no colocate_async", warn(f"{V1}.{key}", COLOCATED + also))


def _separate(key: str) -> Entry:
    """A separate_async key: no effect, quiet in that mode (refused, its refusal quotes them)."""
    return warn(key, SEPARATE, lambda v, cfg: is_off(v, default_of(key)) or trainer_mode(cfg) == "separate_async")


def _separate_keys() -> list[str]:
    """The leaves of trainer.v1.separate_async."""
    group = SeparateAsyncConfig()
    return [f"{V1}.separate_async.{p}" for p in all_paths(SeparateAsyncConfig) if not is_dataclass(get_path(group, p))]


def _v1() -> list[Entry]:
    sampler = " (verl's synchronous sampling does not read it either)"
    out = [_mode(), _colocated("colocate_async.num_warmup_batches"),
           _colocated("sampler.max_off_policy_threshold", sampler),
           _colocated("sampler.max_off_policy_strategy", sampler),
           refuse(f"{V1}.sampler.custom_sampler.path", REPLAY_BUFFER, "remove it"),
           refuse(f"{V1}.sampler.custom_sampler.name", REPLAY_BUFFER, "remove it"),
           refuse(f"{V1}.sampler.sampler_kwargs", f"arguments of a custom replay buffer (read only by one, "
                  f"{V1}.sampler.custom_sampler)", "remove them", no_entries),
           warn(f"{V1}.sampler.sync_refill_failed_groups", "lathe's rollout has no failed groups: a trajectory that "
                "fails stops the step with its error")]
    out += [_separate(k) for k in _separate_keys()]
    return [_under_v1(e) for e in out] + [inert(f"{V1}.sync", "verl's synchronous mode has no settings")]


V1_FEATURES = {"verl's V1 trainer (trainer.use_v1, trainer.v1)": _v1}
