"""What a registry entry of ``support.py`` is, and how it judges a value.

An ``Entry`` names a config key lathe accepts but does not act on (fully) yet, and says what happens when
the key holds a value other than its default:

* ``refuse``: the value fails ``load_config`` ("... is not implemented yet in lathe. Fix: ...");
* ``warn``: the value has no effect in lathe (on one device, or lathe always does the same thing); one
  warning lists every such key of a run;
* ``inert``: lathe already behaves as any value asks, so it is accepted silently (a key whose values form a
  closed set is typed as a ``Literal`` in the schema, which rejects the others).

``ok(value, cfg)`` says whether a value is fine as it is (default: the dataclass default, or off).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .coerce import show
from .plan import is_async, is_colocate_async, teacher_devices, trainer_devices
from .schema import LatheConfig
from .tree import get_path

Check = Callable[[Any, Any], bool]
KINDS = ("refuse", "warn", "inert")


@dataclass(frozen=True)
class Entry:
    """One registry entry: ``key`` (dotted), ``kind``, the text that explains it, and its value test."""

    key: str
    kind: str
    text: str                  # refuse: what is not implemented ("LoRA fine-tuning"); warn/inert: why
    fix: str = ""              # refuse: the fix; may use {key}, {value}, {default}
    ok: Check | None = None    # None: the default (or off) is fine, any other value is not
    feature: str = ""          # the heading it is listed under (filled in by ``registry``)
    judge: Callable[[Any, Any], tuple[str, str] | None] | None = None   # a verdict of its own, from (value, cfg)
    when: str = ""             # a key of WHEN: the entry holds only then (the key acts otherwise)

    def verdict(self, value: Any, default: Any, cfg: Any) -> tuple[str, str] | None:
        """(kind, message) when ``value`` is refused or warned about, else None."""
        if self.when and not WHEN[self.when](cfg):
            return None
        if self.judge is not None:
            return self.judge(value, cfg)
        fine = self.ok(value, cfg) if self.ok is not None else is_off(value, default)
        if fine:
            return None
        shown = f"`{self.key}`={show(value)}"
        if self.kind == "warn":
            return "warn", f"{shown} has no effect in lathe: {self.text}."
        return "refuse", (f"{shown}: {self.text} is not implemented yet in lathe. "
                          f"Fix: {self.format(self.fix, value, default)}.")

    def format(self, text: str, value: Any, default: Any, *, shown: str | None = None) -> str:
        return text.format(key=self.key, value=shown or show(value), default=show(default))

    def note(self) -> str:
        """The sentence ``help_for`` adds to the key's help."""
        on = f"On {self.when}: " if self.when else ""
        if self.kind == "refuse":
            return f"{on}Not implemented yet in lathe ({self.text}): a non-default value fails."
        if self.kind == "warn":
            return f"{on}No effect in lathe ({self.text}): a non-default value warns."
        return f"Accepted; lathe behaves the same either way ({self.text})."


def refuse(key: str, text: str, fix: str = "remove it (or set it back to {default})", ok: Check | None = None):
    return Entry(key, "refuse", text, fix, ok)


def warn(key: str, text: str, ok: Check | None = None):
    return Entry(key, "warn", text, ok=ok)


def inert(key: str, text: str):
    """Accepted silently, whatever the value."""
    return Entry(key, "inert", text, ok=lambda v, cfg: True)


# the conditions an entry can be limited to (`only_on`); outside them the code reads the key
WHEN: dict[str, Callable[[Any], bool]] = {
    "one device": lambda cfg: trainer_devices(cfg) == 1,
    # one process: one trainer device and no rollout pool (with a pool, Ray places both and they sync over NCCL/gloo)
    "one process": lambda cfg: trainer_devices(cfg) == 1 and not is_async(cfg),
    "several devices": lambda cfg: trainer_devices(cfg) > 1,
    "synchronous training": lambda cfg: not is_async(cfg),                   # no rollout pool of its own
    "lora_rank=0": lambda cfg: cfg.actor_rollout_ref.model.lora_rank == 0,     # full fine-tuning: no adapters
    "critic.model.lora_rank=0": lambda cfg: cfg.critic.model.lora_rank == 0,   # the critic trains every weight
    "a rollout pool": is_async,                                              # fully asynchronous training
    # where the reward scores before the step goes on anyway: a rollout pool, or DAPO's dynamic sampling
    "a rollout pool or filter_groups": lambda cfg: is_async(cfg) or cfg.algorithm.filter_groups.enable,
    "single-turn": lambda cfg: not cfg.actor_rollout_ref.rollout.multi_turn.enable,
    # no custom agent loops (rollout.agent.agent_loop_config_path unset; with them `rules_agent` judges the group)
    "no custom agent loops": lambda cfg: not (cfg.actor_rollout_ref.rollout.agent or {}).get("agent_loop_config_path"),
    "no reward model": lambda cfg: not cfg.reward_model.enable,             # reward_model.enable=false
    # the reward model has no pool of its own: none, or colocated (reward_model.enable_resource_pool=false)
    "no reward pool": lambda cfg: not (cfg.reward_model.enable and cfg.reward_model.enable_resource_pool),
    # the teachers have no pool of their own (distillation.nnodes x n_gpus_per_node, both >= 1, with distillation on)
    "no teacher pool": lambda cfg: not teacher_devices(cfg),
    # no sequence-classification reward model: none, or a generative judge (reward_model.judge.enable)
    "no classifier reward model": lambda cfg: not cfg.reward_model.enable or cfg.reward_model.judge.enable,
    # verl V1's colocated asynchronous trainer does not run: another trainer.v1.trainer_mode, or trainer.use_v1=false
    "no colocate_async": lambda cfg: not is_colocate_async(cfg),
    # no V1 mode lathe runs is asked for: separate_async (refused), or trainer.use_v1=false (reads no trainer.v1 key)
    "separate_async or use_v1=false": lambda cfg: (not cfg.trainer.use_v1
                                                   or cfg.trainer.v1.trainer_mode == "separate_async"),
}


def only_on(when: str, entry: Entry) -> Entry:
    """`entry`, holding only `when` (a key of WHEN; the code reads the key in the other case)."""
    if when not in WHEN:
        raise ValueError(f"only_on: {when!r} is not one of {', '.join(WHEN)}")
    return replace(entry, when=when)


@functools.lru_cache(maxsize=1)
def defaults() -> LatheConfig:
    """lathe's defaults, which a key's value is judged against."""
    return LatheConfig()


def default_of(key: str) -> Any:
    """The default of the dotted ``key``."""
    return get_path(defaults(), key)


def is_off(value: Any, default: Any) -> bool:
    """The default, or (for a key whose default is off) another spelling of off."""
    if value == default:
        return True
    return default in (None, False) and value in (None, False)


def at_most(limit: int) -> Check:
    return lambda v, cfg: v is None or v <= limit


def one_of(*values: Any) -> Check:
    return lambda v, cfg: v in values


def no_entries(value: Any, cfg: Any = None) -> bool:
    """A dict whose values (nested dicts included, at any depth) are all empty, null or false."""
    if isinstance(value, dict):
        return all(no_entries(v) for v in value.values())
    return not value


def same_as(*sources: str) -> Check:
    """Null, or the value lathe fills in from ``sources`` (what ``to_yaml`` writes back is not a user's choice)."""
    return lambda v, cfg: v is None or any(v == get_path(cfg, s) for s in sources)
