"""Cross-field rules of MoE routing replay (`actor.router_replay.mode`, `rollout.enable_rollout_routing_replay`;
lathe.train.routing). Whether the model has MoE layers, and which implementation runs it, is checked once it is
loaded (`lathe.workers.actor`)."""

from __future__ import annotations

from .errors import ProblemList
from .plan import is_async
from .support_rollout import ROUTING

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
MODE = f"{A}.router_replay.mode"
ENABLE = f"{R}.enable_rollout_routing_replay"


def check_routing_replay(cfg, problems: ProblemList) -> None:
    arr = cfg.actor_rollout_ref
    mode, enable = arr.actor.router_replay.mode, arr.rollout.enable_rollout_routing_replay
    if mode == "R3" and not enable:
        problems.add(f"{MODE}=R3 replays the routing the rollout records, which {ENABLE}=false does not record. "
                     f"Fix: set {ENABLE}=true (or {MODE}=R2: replay the old-log-prob pass's routing).")
    if enable and mode != "R3":
        problems.add(f"{ENABLE}=true records the rollout's routing for {MODE}=R3 only (verl: it conflicts with R2), "
                     f"but {MODE}={mode}. Fix: set {MODE}=R3, or {ENABLE}=false.")
    if mode == "disabled":
        return
    unsupported = [
        (is_async(cfg), "rollout.n_gpus_per_node > 0 (fully-async training)", "train synchronously"),
        (mode == "R3" and bool((arr.rollout.agent or {}).get("agent_loop_config_path")),
         f"{R}.agent.agent_loop_config_path (custom agent loops: their turns' routing is not recorded)",
         f"use {MODE}=R2 (the old-log-prob forward records what the update replays)"),
        (arr.rollout.name == "hf", f"{R}.name=hf (transformers generate records no routing)", f"set {R}.name=lathe"),
        (arr.model.impl == "hf", "actor_rollout_ref.model.impl=hf (transformers' MoE layers)",
         "set it to auto or lathe"),
        (mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode,
         "algorithm.rollout_correction.bypass_mode=true (no old-log-prob pass records the routing)",
         f"use {MODE}=R3, or bypass_mode=false")]
    for bad, what, fix in unsupported:
        if bad:
            problems.add(f"{MODE}={mode} with {what}: {ROUTING} is not implemented yet in lathe beside it. "
                         f"Fix: {fix}, or {MODE}=disabled.")
