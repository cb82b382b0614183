"""`global_profiler`: which tools lathe runs (torch, torch_memory), the settings of torch_memory read from verl's
`global_profiler.global_tool_config.torch_memory.*`, and the rules checked before anything loads.

verl's torch_memory settings (its `TorchMemoryToolConfig` plus the global group's extras) and what each does here:

    trace_alloc_max_entries   the allocator events kept (torch's `max_entries`)            acts
    context / stacks          torch's `_record_memory_history(context=, stacks=)`           acts
    kw_args                   more keywords of `_record_memory_history` (clear_history...)  acts
    stack_depth               verl passes it only to a torch that takes it (none does now)  32 accepted, else warns
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import ProblemList
from .plan import critic_in_use, is_async

PROFILER_TOOLS = {"nsys": "profiling with NVIDIA Nsight Systems", "npu": "profiling on Ascend NPUs"}
STEP_TOOLS = ("torch", "torch_memory")          # what lathe runs; both write files per listed step
MEMORY = "global_profiler.global_tool_config.torch_memory"
CONTEXTS = ("all", "alloc", "state", None)      # torch's _record_memory_history(context=...)
STACKS = ("all", "python")
# `_record_memory_history`'s keywords a user may add through kw_args (enabled/context/stacks/max_entries/device are
# set from the other keys)
HISTORY_KWARGS = ("clear_history", "compile_context", "global_record_annotations", "skip_actions")
STACK_DEPTH = 32                                # verl's default; torch records whole stacks


@dataclass(frozen=True)
class MemoryHistorySettings:
    """How `global_profiler.tool=torch_memory` records (lathe.track.memory_history)."""

    max_entries: int = 100_000
    context: str | None = "all"
    stacks: str = "all"
    kw_args: dict[str, Any] = field(default_factory=dict)


def torch_memory_settings(global_tool_config: dict, *, checkpointing: bool = False) -> MemoryHistorySettings:
    """The torch_memory settings of `global_profiler.global_tool_config` (verl's defaults where unset); the values are
    checked by `check_profiler`. `checkpointing` (gradient checkpointing in a trained model): context `all` records
    as `alloc` (`CHECKPOINTED_CONTEXT`)."""
    t = dict((global_tool_config or {}).get("torch_memory") or {})
    context = t.get("context", "all")
    return MemoryHistorySettings(max_entries=t.get("trace_alloc_max_entries", 100_000),
                                 context="alloc" if checkpointing and context == "all" else context,
                                 stacks=t.get("stacks", "all"), kw_args=dict(t.get("kw_args") or {}))


# On an H200 with torch 2.11, recording with context=all (verl's default: allocations' and frees' stacks) made the
# backward of a gradient-checkpointed update fail inside autograd (SystemError: "returned NULL without setting an
# exception" where the checkpoint recomputes a layer); context=alloc, or no checkpointing, ran. So under checkpointing
# lathe records context=alloc and says so once at load.
CHECKPOINTED_CONTEXT = (f"{MEMORY}.context=all (the default) records as context=alloc in this run (the allocations' "
                        "stacks, not the frees'): with gradient checkpointing on, torch 2.11 fails in the backward "
                        "while frees' stacks are recorded. Fix for the frees' stacks too: "
                        "actor_rollout_ref.model.enable_gradient_checkpointing=false, or gradient_checkpointing_"
                        "layers=0 (and the critic's) for the profiled run.")


def trains_checkpointed(cfg) -> bool:
    """Whether a trained model of the run recomputes layers in backward (the actor's, or a critic's: gradient
    checkpointing on, and not with gradient_checkpointing_layers=0)."""
    def recomputes(model) -> bool:
        return bool(model.enable_gradient_checkpointing) and model.gradient_checkpointing_layers != 0
    return recomputes(cfg.actor_rollout_ref.model) or (critic_in_use(cfg) and recomputes(cfg.critic.model))


def check_profiler(cfg, problems: ProblemList) -> None:
    """`global_profiler`: tool torch or torch_memory (or off), with steps; synchronous runs only
    (lathe.track.profile); torch_memory on CUDA only and with settings torch takes."""
    p = cfg.global_profiler
    if p.tool in PROFILER_TOOLS:
        problems.add(f"global_profiler.tool={p.tool}: {PROFILER_TOOLS[p.tool]} is not implemented yet in lathe. Fix: use "
                     f"global_profiler.tool=torch (a PyTorch profiler trace and a per-phase summary of each listed "
                     f"step) or torch_memory (a CUDA memory snapshot of each), or remove it.")
        return
    steps = p.steps or []
    if p.tool == "torch" and not steps:
        problems.add("global_profiler.tool=torch but global_profiler.steps lists no step, so nothing would be "
                     "profiled. Fix: set global_profiler.steps=[N,...] (the first step is 1), or remove the tool.")
    for key, value in (("steps", steps), ("with_stack", p.with_stack)):
        if p.tool is None and value:
            problems.add(f"global_profiler.{key}={value} but global_profiler.tool is not set, so nothing would be "
                         f"profiled. Fix: set global_profiler.tool=torch, or remove global_profiler.{key}.")
    if p.tool == "torch_memory" and p.with_stack:
        problems.add("global_profiler.with_stack=True is a setting of global_profiler.tool=torch; torch_memory "
                     f"records stacks as {MEMORY}.stacks says. Fix: remove global_profiler.with_stack.")
    bad = [s for s in steps if s < 1]
    if bad:
        problems.add(f"global_profiler.steps={steps}: {bad} are not step numbers (the first step is 1). Fix: list "
                     f"steps >= 1.")
    if p.tool in STEP_TOOLS and is_async(cfg):
        problems.add(f"global_profiler.tool={p.tool} profiles the steps of the synchronous loop (the driver and every "
                     "Ray rank for the same step), but this run is fully asynchronous (a rollout pool of "
                     f"rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node}), whose pools run freely with no "
                     "common step to profile; that is not implemented yet. Fix: profile a synchronous run, or remove "
                     "global_profiler.tool.")
    if p.tool == "torch_memory":
        _check_torch_memory(cfg, problems)


def _check_torch_memory(cfg, problems: ProblemList) -> None:
    if cfg.trainer.device == "cpu":
        problems.add("global_profiler.tool=torch_memory records the CUDA caching allocator's history, but "
                     "trainer.device=cpu has no such allocator. Fix: train on a GPU (trainer.device=cuda or auto), "
                     "or use global_profiler.tool=torch (a trace and per-phase summary, on the CPU too).")
    raw = dict((cfg.global_profiler.global_tool_config or {}).get("torch_memory") or {})
    known = {"trace_alloc_max_entries", "stack_depth", "context", "stacks", "kw_args", "name", "_target_"}
    for key in sorted(set(raw) - known):
        problems.add(f"{MEMORY}.{key}={raw[key]!r} is not a torch_memory setting. Fix: remove it (the settings are "
                     f"{', '.join(sorted(known - {'name', '_target_'}))}).")
    s = torch_memory_settings(cfg.global_profiler.global_tool_config)
    if s.context == "all" and trains_checkpointed(cfg):
        warnings.warn(CHECKPOINTED_CONTEXT, UserWarning, stacklevel=4)
    for key, value in (("trace_alloc_max_entries", s.max_entries), ("stack_depth", raw.get("stack_depth", 1))):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.add(f"{MEMORY}.{key}={value!r}: expected a whole number >= 1. Fix: e.g. "
                         f"{MEMORY}.{key}={100_000 if key.startswith('trace') else STACK_DEPTH}.")
    depth = raw.get("stack_depth", STACK_DEPTH)
    if isinstance(depth, int) and depth >= 1 and depth != STACK_DEPTH:
        warnings.warn(f"{MEMORY}.stack_depth={depth} has no effect: torch records whole stacks (verl passes the depth "
                      "only to a torch that takes one, and none does).", UserWarning, stacklevel=4)
    for key, value, allowed in (("context", s.context, CONTEXTS), ("stacks", s.stacks, STACKS)):
        if value not in allowed:
            problems.add(f"{MEMORY}.{key}={value!r} is not one torch takes. Fix: set it to one of "
                         f"{', '.join(str(a) if a is not None else 'null' for a in allowed)}.")
    for key in sorted(set(s.kw_args) - set(HISTORY_KWARGS)):
        problems.add(f"{MEMORY}.kw_args.{key}: torch's _record_memory_history takes no such keyword here (lathe sets "
                     f"enabled, context, stacks, max_entries and device from the other settings). Fix: remove it "
                     f"(kw_args takes {', '.join(HISTORY_KWARGS)}).")
