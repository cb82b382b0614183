"""verl's optimizer choice, checked without importing torch: `optim.optimizer` (a class name) from the module
`optim.optimizer_impl`, built with `lr`, `weight_decay`, `betas` (Adam's) and `override_optimizer_config` on top
(`lathe.train.optim.optimizer_kwargs`).

Here, at `load_config`: the module is installed (found on the import path, not imported), the class name is a
name, the extra arguments are named. What needs the class itself (it exists, takes those arguments, steps without
a closure, and where lathe can run it: `lathe.train.optim.check_optimizer`) is checked once torch is imported,
before any model loads.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import warnings

from .errors import ProblemList
from .plan import critic_in_use

# Megatron's CPU-optimizer settings, which verl's Megatron scripts pass in override_optimizer_config: no
# optimizer argument (lathe's switch is fsdp_config.optimizer_offload), so they are left out of the arguments
MEGATRON_CPU_OPTIMIZER = frozenset({"optimizer_cpu_offload", "optimizer_offload_fraction", "offload_fraction",
                                    "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer"})
EXAMPLES = "e.g. torch.optim (AdamW, Adam, SGD, ...), torchao.optim (_AdamW) or bitsandbytes.optim (AdamW8bit)"


def module_installed(name: str) -> bool | None:
    """Whether module `name` (dotted) can be imported, found without importing it or its packages: True, False, or
    None when that cannot be told without importing (a package whose submodules are not files)."""
    if name in sys.modules:
        return True
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return False
    for part in parts[1:]:
        if spec is None:
            return False
        if spec.submodule_search_locations is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def optimizer_problems(optim, key: str) -> list[str]:
    """What is wrong with the optim group `key`'s optimizer choice, as far as it shows without importing it."""
    impl, name, extra = optim.optimizer_impl, optim.optimizer, optim.override_optimizer_config or {}
    out = []
    if not all(part.isidentifier() for part in str(impl).split(".")):
        out.append(f"`{key}.optimizer_impl`={impl!r} is not a module name. Fix: name the module the optimizer class "
                   f"is taken from, {EXAMPLES}.")
    elif module_installed(impl) is False:
        out.append(f"`{key}.optimizer_impl`={impl}: no module of that name is installed (lathe takes "
                   f"{key}.optimizer={name} from it). Fix: name an installed module, {EXAMPLES}, or install the "
                   f"package that provides {impl}.")
    if not str(name).isidentifier():
        out.append(f"`{key}.optimizer`={name!r} is not a class name. Fix: name a class of {impl} (torch.optim has "
                   "AdamW, Adam, SGD, ...).")
    bad = sorted(str(k) for k in extra if not str(k).isidentifier() or k == "params")
    if bad:
        out.append(f"`{key}.override_optimizer_config`={extra}: {', '.join(bad)} cannot be an optimizer's keyword "
                   f"argument (params are the model's). Fix: remove {', '.join(bad)}; the other entries are passed to "
                   f"{impl}.{name} as keyword arguments.")
    return out


def megatron_offload_notice(optim, key: str) -> str | None:
    """The note that Megatron's CPU-optimizer keys in `override_optimizer_config` have no effect (None: none set)."""
    held = sorted(set(optim.override_optimizer_config or {}) & MEGATRON_CPU_OPTIMIZER)
    if not held:
        return None
    return (f"`{key}.override_optimizer_config` {', '.join(held)} have no effect in lathe: Megatron's CPU-optimizer "
            "settings; lathe streams the optimizer state through the device with fsdp_config.optimizer_offload=true.")


def check_optimizer_group(optim, key: str, problems: ProblemList) -> None:
    """`optimizer_problems` and the schedule's errors into `problems`; the Megatron-offload note and the schedule's
    keys that have no effect as warnings."""
    errors, notes = schedule_problems(optim, key)
    for message in optimizer_problems(optim, key) + errors:
        problems.add(message)
    for notice in [megatron_offload_notice(optim, key), *notes]:
        if notice is not None:
            warnings.warn(notice, UserWarning, stacklevel=4)


def check_optimizers(cfg, problems: ProblemList) -> None:
    """The actor's optimizer choice, and the critic's when a critic trains."""
    check_optimizer_group(cfg.actor_rollout_ref.actor.optim, "actor_rollout_ref.actor.optim", problems)
    if critic_in_use(cfg):
        check_optimizer_group(cfg.critic.optim, "critic.optim", problems)


def fill_schedule(optim) -> None:
    """verl's other names for the schedule onto `lr_scheduler_type`: the FSDP config's older `warmup_style` and
    the Megatron config's `lr_decay_style` (and its spelling inverse-square-root)."""
    if optim.warmup_style is not None:
        optim.lr_scheduler_type = optim.warmup_style
    if optim.lr_decay_style is not None:
        optim.lr_scheduler_type = optim.lr_decay_style.replace("-", "_")


def schedule_problems(optim, key: str) -> tuple[list[str], list[str]]:
    """(errors, notes) of the optim group `key`'s learning-rate schedule (`lathe.train.optim.schedule_rate`), read
    after `fill_schedule`: keys that contradict each other or that WSD needs; keys the schedule does not read."""
    errors, notes = [], []
    style, names = optim.lr_scheduler_type, (optim.warmup_style, optim.lr_decay_style)
    if None not in names and names[0] != names[1].replace("-", "_"):
        errors.append(f"`{key}.warmup_style`={names[0]} and `{key}.lr_decay_style`={names[1]} name two schedules "
                      f"(verl's FSDP and Megatron names of one key). Fix: set one of them.")
    if optim.lr_decay_steps is not None and optim.lr_decay_steps <= 0:
        errors.append(f"`{key}.lr_decay_steps`={optim.lr_decay_steps}: the schedule's length must be positive. Fix: "
                      "set a number of update steps, or null for the run's training steps.")
    wsd = optim.lr_wsd_decay_steps
    if style == "WSD" and (wsd is None or wsd <= 0):
        errors.append(f"`{key}.lr_scheduler_type`=WSD anneals over its last lr_wsd_decay_steps steps, and "
                      f"`{key}.lr_wsd_decay_steps`={wsd}. Fix: set {key}.lr_wsd_decay_steps to a positive number of "
                      "steps (at most lr_decay_steps), as Megatron requires.")
    elif style == "WSD" and optim.lr_decay_steps is not None and wsd > optim.lr_decay_steps:
        errors.append(f"`{key}.lr_wsd_decay_steps`={wsd} is longer than `{key}.lr_decay_steps`="
                      f"{optim.lr_decay_steps}, of which the annealing is the last part. Fix: shorten it.")
    start = optim.init_lr_ratio
    if start is not None and not 0.0 <= start <= 1.0:
        errors.append(f"`{key}.init_lr_ratio`={start}: the warm-up's start is a fraction of lr, from 0 to 1. Fix: set "
                      "it within [0, 1], or null.")
    elif start is not None and optim.lr_warmup_init:
        errors.append(f"`{key}.init_lr_ratio`={start} and `{key}.lr_warmup_init`={optim.lr_warmup_init} give two "
                      "starts of the warm-up (a fraction of lr and Megatron's rate). Fix: set one.")
    ratio = optim.min_lr_ratio or 0.0
    if optim.min_lr < 0 or ratio < 0:
        errors.append(f"`{key}.min_lr`={optim.min_lr}, `{key}.min_lr_ratio`={ratio}: a floor cannot be negative. "
                      "Fix: set it to 0 or more.")
    if style == "constant":
        unread = [f"`{key}.{k}`={v}" for k, v in (("min_lr", optim.min_lr), ("lr_decay_steps", optim.lr_decay_steps))
                  if v]
        if unread:
            notes.append(f"{' and '.join(unread)} {'have' if len(unread) > 1 else 'has'} no effect: the learning "
                         "rate is constant after warm-up (lr_scheduler_type / lr_decay_style constant).")
    if style != "WSD" and (wsd is not None or optim.lr_wsd_decay_style != "exponential"):
        notes.append(f"`{key}.lr_wsd_*` have no effect: they shape the WSD schedule's annealing, and the schedule "
                     f"is {style}.")
    return errors, notes
