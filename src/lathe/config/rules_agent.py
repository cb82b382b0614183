"""Rules for verl's custom agent loops (`actor_rollout_ref.rollout.agent.agent_loop_config_path`,
`lathe.rollout.agent.custom`): what they run with, and what they are not implemented with yet."""

from __future__ import annotations

import os
import warnings

from .errors import IgnoredKeysWarning, ProblemList
from .schema import LatheConfig
from .support_rollout import VERL_AGENT_WORKERS, unsupported_agent_keys

A = "actor_rollout_ref.rollout.agent"


def apply_tool_agent(cfg: LatheConfig) -> None:
    """verl's `agent.default_agent_loop=tool_agent` (its tool loop, whatever `multi_turn.enable` says) turns on
    lathe's tool loop (`multi_turn.enable`), unless custom loops are set (`check_custom_agent_loops` refuses that)."""
    agent = cfg.actor_rollout_ref.rollout.agent or {}
    if agent.get("default_agent_loop") == "tool_agent" and not agent.get("agent_loop_config_path"):
        cfg.actor_rollout_ref.rollout.multi_turn.enable = True


def check_custom_agent_loops(cfg: LatheConfig, problems: ProblemList) -> None:
    agent = cfg.actor_rollout_ref.rollout.agent or {}
    path = agent.get("agent_loop_config_path")
    if not path:
        return
    ro = cfg.actor_rollout_ref.rollout
    refused = unsupported_agent_keys(agent)
    if refused:
        problems.add(refused)
    if agent.get("num_workers") not in (None, VERL_AGENT_WORKERS):
        warnings.warn(f"{A}.num_workers={agent['num_workers']} has no effect in lathe: its custom agent loops run as "
                      "coroutines of the rollout's own thread, beside the engine.", IgnoredKeysWarning, stacklevel=2)
    if not os.path.isfile(os.path.expanduser(str(path))):
        problems.add(f"{A}.agent_loop_config_path={path!r}: no such file. Fix: point it at a YAML list of agent "
                     f"loops (- name: my_agent / _target_: my_pkg.agents.MyAgentLoop), or remove it.")
    if agent.get("default_agent_loop") == "tool_agent":
        problems.add(f"{A}.default_agent_loop=tool_agent with custom agent loops: lathe's tool loop "
                     f"(multi_turn.enable) and custom loops in one run are not implemented yet. Fix: name "
                     f"single_turn_agent or one of your loops, or remove {A}.agent_loop_config_path to run the tool "
                     f"loop.")
    not_yet = [(ro.data_parallel_size > 1, f"actor_rollout_ref.rollout.data_parallel_size={ro.data_parallel_size}"),
               (ro.name == "hf", "actor_rollout_ref.rollout.name=hf (transformers generate streams no requests)"),
               (cfg.actor_rollout_ref.actor.use_prefix_grouper, "actor_rollout_ref.actor.use_prefix_grouper=true "
                                                                 "(a loop may change a sample's prompt)")]
    for bad, what in not_yet:
        if bad:
            problems.add(f"{A}.agent_loop_config_path with {what}: custom agent loops are not implemented there yet "
                         f"(they run on engine replicas, tensor-parallel or not). Fix: "
                         f"remove one of the two.")
