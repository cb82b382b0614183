"""lathe's typed, self-validating config tree with verl's key names.

    from lathe.config import load_config, to_yaml
    cfg = load_config("gsm8k_grpo", ["actor_rollout_ref.rollout.n=8", "trainer.logger=[console]"])
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size

This package is a leaf: it imports only the standard library and PyYAML (never torch).
"""

from .errors import ConfigError
from .loader import describe_preset, list_presets, load_config
from .plan import (BatchPlan, RunPlan, batch_plan, critic_in_use, is_async, is_colocate_async, resolve_devices,
                   run_plan, trainer_mode)
from .schema import LatheConfig
from .help import help_for
from .tree import to_dict, to_yaml

__all__ = [
    "BatchPlan",
    "ConfigError",
    "LatheConfig",
    "RunPlan",
    "batch_plan",
    "critic_in_use",
    "describe_preset",
    "help_for",
    "is_async",
    "is_colocate_async",
    "list_presets",
    "load_config",
    "resolve_devices",
    "run_plan",
    "to_dict",
    "to_yaml",
    "trainer_mode",
]
