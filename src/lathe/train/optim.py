"""Optimizer and learning-rate schedule from verl's `optim.*` keys.

The optimizer is verl's choice: the class `optim.optimizer` of the module `optim.optimizer_impl` (torch.optim's
AdamW by default; torch.optim's Adam, SGD, ...; `torchao.optim`'s `_AdamW`, `bitsandbytes.optim`'s `AdamW8bit`),
called with `lr`, `weight_decay`, `betas` when the name is an Adam's (it holds "adam" or "ademamix", lower-cased) and
`override_optimizer_config` on top (`optimizer_kwargs`). A name that is not in the module is looked up without
regard to case when exactly one optimizer class matches (`adamw`, Megatron's `sgd`). Where it runs:

- FSDP2 shards (`sharded`): the class on the shards (DTensors), whose mixed precision and `param_offload` FSDP2 does;
  AdamW with `optimizer_offload` alone is `OffloadedAdamW` (the moments in host memory, streamed through the device);
- one device with master weights (a mixed precision policy): lathe's AdamW (`MasterAdamW`, which also offloads), or
  any other class over the fp32 masters (`lathe.train.master_weights.master_optimizer`);
- one device without: the class on the parameters.

`MasterAdamW` and `OffloadedAdamW` take lr, betas, weight_decay and eps: AdamW with any other argument runs as any
other class does, and where only they can run it (offload on one device; `optimizer_offload` alone on FSDP2 shards),
another class or argument is refused up front (`check_optimizer`, which `lathe train` and `lathe sft` run before any
model loads, with the errors `build_optimizer` would raise).
"""

from __future__ import annotations

import importlib
import inspect
import math
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lathe.dtypes import short_name
from lathe.config.errors import ConfigError, closest, did_you_mean
from lathe.config.rules_optim import EXAMPLES, MEGATRON_CPU_OPTIMIZER
from lathe.train.master import MasterAdamW
from lathe.train.master_weights import master_optimizer
from lathe.train.offload import requested_offload
from lathe.train.offloaded_adamw import OffloadedAdamW
from lathe.train.precision import FP32, PrecisionPolicy

FAST_ADAMW_ARGS = {"lr", "betas", "weight_decay", "eps"}     # what MasterAdamW and OffloadedAdamW take


def adam_like(name: str) -> bool:
    """verl's rule for passing `betas`: the class name, lower-cased, holds "adam" or "ademamix"."""
    lowered = str(name).lower()
    return "adam" in lowered or "ademamix" in lowered


def optimizer_kwargs(optim_cfg) -> dict[str, Any]:
    """The optimizer's keyword arguments: lr, weight_decay, betas (Adam's), then `override_optimizer_config`, which
    may add or override any of them (Megatron's CPU-optimizer keys, no arguments of any class, left out)."""
    kwargs: dict[str, Any] = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.weight_decay}
    if adam_like(getattr(optim_cfg, "optimizer", "AdamW")):
        kwargs["betas"] = tuple(optim_cfg.betas)
    for name, value in (getattr(optim_cfg, "override_optimizer_config", None) or {}).items():
        if name not in MEGATRON_CPU_OPTIMIZER:
            kwargs[name] = tuple(value) if name == "betas" and isinstance(value, list) else value
    return kwargs


def optimizer_class(optim_cfg, key: str) -> type:
    """The class `optim.optimizer` names in `optim.optimizer_impl`; a ConfigError naming the key and the fix when it
    cannot be imported, is not there, or is no optimizer lathe's update can step."""
    impl, name = getattr(optim_cfg, "optimizer_impl", "torch.optim"), getattr(optim_cfg, "optimizer", "AdamW")
    try:
        module = importlib.import_module(impl)
    except ImportError as e:
        raise ConfigError(f"`{key}.optimizer_impl`={impl}: importing it fails ({e}). Fix: name an installed module, "
                          f"{EXAMPLES}, or install the package that provides {impl}.") from None
    known = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.optim.Optimizer)
                   and v is not torch.optim.Optimizer)
    cls = getattr(module, name, None)
    if cls is None:
        same = [n for n in known if n.lower() == str(name).lower()]
        if len(same) != 1:
            lower = {n.lower(): n for n in known}
            hint = did_you_mean([lower[n] for n in closest(str(name).lower(), lower)])
            raise ConfigError(f"`{key}.optimizer`={name}: {impl} has no such class.{hint} Fix: name one of its "
                              f"optimizers: {', '.join(known) or '(none found)'}.")
        cls = getattr(module, same[0])
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ConfigError(f"`{key}.optimizer`={name}: {impl}.{name} is not an optimizer class (a subclass of "
                          f"torch.optim.Optimizer). Fix: name one of {impl}'s optimizers: {', '.join(known)}.")
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"`{key}.optimizer`={name}: its step() needs a closure that evaluates the loss again, which "
                          "lathe's update does not give. Fix: choose an optimizer that steps on the gradients alone "
                          "(AdamW, Adam, SGD, ...).")
    return cls


def checked_kwargs(cls: type, optim_cfg, key: str) -> dict[str, Any]:
    """`optimizer_kwargs`, each one `cls` takes (a weight_decay of 0 dropped where it takes none); else a ConfigError
    naming the key that set the argument."""
    kwargs = optimizer_kwargs(optim_cfg)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    takes = [n for n, p in params.items() if n not in ("self", "params") and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    extra = getattr(optim_cfg, "override_optimizer_config", None) or {}
    for arg in [a for a in kwargs if a not in takes]:
        if arg == "weight_decay" and arg not in extra and not kwargs[arg]:
            del kwargs[arg]
            continue
        where = (f"`{key}.override_optimizer_config`={extra}" if arg in extra else f"`{key}.{arg}`={kwargs[arg]}")
        eps = f" (verl's Megatron key {key}.eps sets it there too)" if arg == "eps" else ""
        fix = (f"remove {arg} from {key}.override_optimizer_config{eps}, or spell it as one of those" if arg in extra
               else f"set {key}.weight_decay=0" if arg == "weight_decay" else f"choose another {key}.optimizer")
        raise ConfigError(f"{where}: {shown(optim_cfg, cls)} takes no argument {arg} (it takes {', '.join(takes)}). "
                          f"Fix: {fix}.")
    return kwargs


def shown(optim_cfg, cls: type) -> str:
    """The class as the keys name it: `torch.optim.SGD`."""
    return f"{getattr(optim_cfg, 'optimizer_impl', 'torch.optim')}.{cls.__name__}"


def optimizer_choice(optim_cfg, key: str = "optim") -> tuple[type, dict[str, Any]]:
    """(class, keyword arguments) of the optim group `key`, checked (ConfigError naming the key and the fix)."""
    cls = optimizer_class(optim_cfg, key)
    return cls, checked_kwargs(cls, optim_cfg, key)


def lathe_adamw(cls: type, kwargs: dict[str, Any]) -> bool:
    """torch's AdamW with arguments `MasterAdamW` and `OffloadedAdamW` take (their fast and offloading paths)."""
    return cls is torch.optim.AdamW and set(kwargs) <= FAST_ADAMW_ARGS


def check_placement(cls: type, kwargs: dict[str, Any], *, key: str, fsdp_key: str, sharded: bool,
                    offload_params: bool, offload_state: bool) -> None:
    """A ConfigError where only lathe's own AdamW can run the offload asked for and `cls`/`kwargs` is not it."""
    only_lathes = (offload_state and not offload_params) if sharded else (offload_params or offload_state)
    if not only_lathes or lathe_adamw(cls, kwargs):
        return
    args = sorted(set(kwargs) - FAST_ADAMW_ARGS) if cls is torch.optim.AdamW else []
    what = (f"{key}.override_optimizer_config's {', '.join(args)}" if args
            else f"{key}.optimizer={cls.__name__}")
    lathe_way = f"use {key}.optimizer=AdamW (torch.optim) with no other override_optimizer_config than eps"
    if sharded:
        raise ConfigError(
            f"`{fsdp_key}.optimizer_offload`=true with {what}: on FSDP2 shards lathe streams the optimizer state "
            f"through the device for its own AdamW only (OffloadedAdamW). Fix: also set {fsdp_key}.param_offload=true "
            f"(FSDP2's offload policy keeps the shards and any optimizer's state in host memory; the step runs on "
            f"the CPU), or set optimizer_offload=false, or {lathe_way}.")
    asked = " and ".join(f"`{fsdp_key}.{k}`=true" for k, on in (("param_offload", offload_params),
                                                                  ("optimizer_offload", offload_state)) if on)
    raise ConfigError(
        f"{asked} with {what}: on one device lathe offloads through its own AdamW only (MasterAdamW). Fix: set "
        f"{fsdp_key}.param_offload=false and optimizer_offload=false, or {lathe_way}.")


def check_optimizer(optim_cfg, fsdp_cfg, device: torch.device, *, key: str, fsdp_key: str, sharded: bool) -> None:
    """What `build_optimizer` would refuse for this group, before any model loads: the class, its arguments (it is
    built once over a one-element CPU tensor, so that a value it rejects shows here; no device memory is taken) and
    the offload `fsdp_cfg` asks for on `device`."""
    cls, kwargs = optimizer_choice(optim_cfg, key)
    check_placement(cls, kwargs, key=key, fsdp_key=fsdp_key, sharded=sharded,
                    **requested_offload(fsdp_cfg, device, sharded=sharded))
    construct(cls, [torch.zeros(1, requires_grad=True)], kwargs, key)


def construct(cls: type, params, kwargs: dict[str, Any], key: str, build=None) -> torch.optim.Optimizer:
    """`(build or cls)(params, **kwargs)`; a value the class rejects is a ConfigError naming the group `key`."""
    try:
        return (build or cls)(params, **kwargs)
    except (TypeError, ValueError) as e:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"`{key}`: {cls.__name__}({args}) fails: {e}. Fix: change what it names "
                          f"({key}.lr, weight_decay, betas or override_optimizer_config), or choose another "
                          f"{key}.optimizer.") from None


def build_optimizer(params, optim_cfg, *, key: str = "optim", fsdp_key: str = "fsdp_config",
                    policy: PrecisionPolicy = FP32, offload_params: bool = False, offload_state: bool = False,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer of the optim group `key` (`optimizer_choice`) over the trainable `params`, placed as the module
    docstring says; `fsdp_key` names the offload switches in errors."""
    cls, kwargs = optimizer_choice(optim_cfg, key)
    check_placement(cls, kwargs, key=key, fsdp_key=fsdp_key, sharded=sharded, offload_params=offload_params,
                    offload_state=offload_state)
    params = [p for p in params if p.requires_grad]
    if sharded:
        opt = (OffloadedAdamW(params, **kwargs) if offload_state and not offload_params and lathe_adamw(cls, kwargs)
               else construct(cls, params, kwargs, key))
    elif offload_params or offload_state or policy.mixed and lathe_adamw(cls, kwargs):
        opt = MasterAdamW(params, policy=policy, offload_params=offload_params, offload_state=offload_state,
                          **kwargs)
    elif policy.mixed:
        opt = construct(cls, params, kwargs, key, build=partial(master_optimizer, cls, policy=policy))
    else:
        opt = construct(cls, params, kwargs, key)
    materialize_state(opt)
    return opt


def materialize_state(opt: torch.optim.Optimizer) -> None:
    """Create the moments of torch's Adam/AdamW or lathe's `MasterAdamW` now, as their first step would (zeros, step
    0), so that they take their device memory before any activation or KV cache does: made at the first step, they
    are carved from whatever PyTorch's allocator has cached then (the update's freed activations, the sleeping
    engine's KV blocks) and hold those segments from the driver. Made up front, e2e's peak reserved memory fell
    (0.5B 38.5 -> 33.3 GiB, 1.5B with the reference 66.6 -> 57.3 GiB on an H200, the same step times), and the
    engine's KV cache is sized with them from its first step. Other classes keep their own first step: their state
    does not start at zeros (SGD's momentum starts at the gradient). Exact: torch's step over zero gradients at lr 0
    and weight decay 0 changes no parameter and leaves zero moments; its step counts go back to 0."""
    if isinstance(opt, MasterAdamW):
        opt.init_state()
        return
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return
    saved = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:        # (Adam's weight decay joins the gradient: off too)
            g["lr"], g["weight_decay"] = g["lr"] * 0 if torch.is_tensor(g["lr"]) else 0.0, 0.0
        opt.step()
    finally:
        for g, (lr, decay) in zip(opt.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, decay
        opt.zero_grad(set_to_none=True)
    for state in opt.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def runs_lathe_adamw(optim_cfg) -> bool:
    """Whether the optim group (None: the default) runs lathe's own AdamW, the one that offloads its state."""
    return optim_cfg is None or lathe_adamw(*optimizer_choice(optim_cfg))


def optimizer_state(optim_cfg, dtype: torch.dtype) -> tuple[str, int]:
    """(what, bytes a parameter) of the state the chosen optimizer keeps for parameters of `dtype` (the memory plan):
    AdamW's two moments; another class's parameter-sized state tensors, counted after one step over a small tensor
    (SGD with momentum: one; without: none). A class that cannot step there (one that needs a GPU) is taken as AdamW."""
    element = torch.empty((), dtype=dtype).element_size()
    if runs_lathe_adamw(optim_cfg):
        return "AdamW moments, 2 x " + short_name(dtype), 2 * element
    cls, kwargs = optimizer_choice(optim_cfg)
    p = torch.zeros(256, dtype=dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        opt = cls([p], **kwargs)
        opt.step()
    except Exception:                           # noqa: BLE001 (an estimate: AdamW's size stands in)
        return f"{cls.__name__} state (taken as AdamW's), 2 x {short_name(dtype)}", 2 * element
    tensors = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.numel() == p.numel()]
    nbytes = sum(t.element_size() for t in tensors)
    kinds = {short_name(t.dtype) for t in tensors}
    what = (f"{len(tensors)} x {kinds.pop()}" if len(kinds) == 1 else
            f"{nbytes} bytes a parameter" if tensors else "none")
    return f"{cls.__name__} state, {what}", nbytes


def decay_steps(optim_cfg, total_steps: int) -> int:
    """The steps the schedule spans, warmup included: Megatron's `lr_decay_steps`, else the run's."""
    steps = getattr(optim_cfg, "lr_decay_steps", None)
    return int(steps) if steps is not None else total_steps


def warmup_steps(optim_cfg, total_steps: int) -> int:
    """`lr_warmup_steps` when > 0, else `lr_warmup_steps_ratio` x the decay steps (verl's rule, both backends)."""
    if optim_cfg.lr_warmup_steps is not None and optim_cfg.lr_warmup_steps > 0:
        return int(optim_cfg.lr_warmup_steps)
    return int(optim_cfg.lr_warmup_steps_ratio * decay_steps(optim_cfg, total_steps))


def _anneal(style: str, progress: float, cycles: float = 0.5) -> float:
    """The fraction of the way from the floor to the peak at `progress` (0 .. 1) through a decay of `style`."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress))
    if style == "exponential":
        return 2.0 * 0.5 ** progress - 1.0
    return 1.0 - math.sqrt(progress)                     # minus_sqrt


def schedule_rate(step: int, *, peak: float, style: str, warm: int, decay: int, start: float = 0.0,
                  floor: float = 0.0, cycles: float = 0.5, wsd_steps: int | None = None,
                  wsd_style: str = "exponential") -> float:
    """The learning rate of the update after `step` scheduler steps (the first update's is step 0's): verl's
    FSDP schedules (constant, cosine) and Megatron's (`OptimizerParamScheduler`: linear, inverse_square_root, WSD)
    are one formula. A linear warmup from `start` reaches `peak` at step `warm`; then `style` decays to `floor` at
    step `decay` (the inverse square root: peak x sqrt(warm / step), not below the floor), which holds after it; WSD
    holds the peak until its last `wsd_steps` steps, which anneal by `wsd_style`. A constant schedule stays at
    the peak. (verl's cosine rises again past its last step: lathe holds the floor, as Megatron does.)"""
    if warm > 0 and step <= warm:
        return start + (peak - start) * step / warm
    if style == "constant":
        return peak
    if step > decay:
        return floor
    if style == "inverse_square_root":
        return max(floor, peak * math.sqrt(max(warm, 1) / max(step, 1)))
    if style == "WSD":
        stable = decay - wsd_steps
        coeff = 1.0 if step <= stable else _anneal(wsd_style, (step - stable) / wsd_steps)
    else:
        coeff = _anneal(style, (step - warm) / max(1, decay - warm), cycles)
    return floor + coeff * (peak - floor)


def floor_rate(optim_cfg) -> float:
    """The decay's floor: Megatron's absolute `min_lr`, else `min_lr_ratio` x lr (the config allows one)."""
    if getattr(optim_cfg, "min_lr", 0.0):
        return float(optim_cfg.min_lr)
    return (getattr(optim_cfg, "min_lr_ratio", 0.0) or 0.0) * optim_cfg.lr


def start_rate(optim_cfg) -> float:
    """The warm-up's first rate: `init_lr_ratio` x lr when set, else Megatron's `lr_warmup_init` (the config allows
    one)."""
    ratio = getattr(optim_cfg, "init_lr_ratio", None)
    return ratio * optim_cfg.lr if ratio is not None else getattr(optim_cfg, "lr_warmup_init", 0.0) or 0.0


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`schedule_rate` over the run, stepped once per update step, as a factor on each group's lr.

    verl's FSDP keys (lr_scheduler_type constant or cosine, min_lr_ratio, num_cycles, zero_indexed_step) and its
    Megatron ones (lr_decay_style, which config filling copied to lr_scheduler_type; lr_decay_steps,
    lr_warmup_init, min_lr, lr_wsd_*) set the one schedule, and init_lr_ratio (verl's cosine's argument) its
    start. `zero_indexed_step=false` counts the cosine's steps from 1, as verl's cosine does (its constant schedule
    ignores the key).
    """
    peak = optim_cfg.lr
    style = getattr(optim_cfg, "lr_scheduler_type", None) or getattr(optim_cfg, "warmup_style", None) or "constant"
    shift = int(style == "cosine" and not getattr(optim_cfg, "zero_indexed_step", True))
    rate = partial(
        schedule_rate, peak=peak, style=style, warm=warmup_steps(optim_cfg, total_steps),
        decay=decay_steps(optim_cfg, total_steps), start=start_rate(optim_cfg),
        floor=floor_rate(optim_cfg), cycles=getattr(optim_cfg, "num_cycles", 0.5),
        wsd_steps=getattr(optim_cfg, "lr_wsd_decay_steps", None),
        wsd_style=getattr(optim_cfg, "lr_wsd_decay_style", "exponential"))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rate(step + shift) / peak if peak else 0.0)


ADAMW = "torch.optim.AdamW"    # what a checkpoint without `optimizer_class` (lathe before optim.optimizer acted) holds


def optimizer_name(optimizer) -> str:
    """The update rule `optimizer` runs, as `module.Class`, whatever lathe's form of it: `MasterAdamW`,
    `OffloadedAdamW` and torch's AdamW are one (their states interchange), `master_optimizer`'s `Master<cls>` is cls."""
    if isinstance(optimizer, MasterAdamW | torch.optim.AdamW):
        return ADAMW
    for cls in type(optimizer).__mro__:
        if not cls.__module__.startswith("lathe.") and issubclass(cls, torch.optim.Optimizer):
            module = cls.__module__.rsplit(".", 1)[0] if cls.__module__.startswith("torch.optim.") else cls.__module__
            return f"{module}.{cls.__name__}"
    return type(optimizer).__name__


def check_optimizer_class(saved: dict, optimizer, path: Path, what: str) -> None:
    """A checkpoint's optimizer state resumes only into the optimizer that wrote it (another class would take its
    hyperparameters and state as its own and fail, or worse, step with them)."""
    wrote, runs = saved.get("optimizer_class", ADAMW), optimizer_name(optimizer)
    if wrote != runs:
        module, _, name = wrote.rpartition(".")
        raise ValueError(f"{what} checkpoint {path} holds the state of {wrote}, but this run's {what} optimizer is "
                         f"{runs}. Fix: resume with the {what}'s optim.optimizer={name} optim.optimizer_impl={module} "
                         f"(its override_optimizer_config too), or start a new run from its weights.")
