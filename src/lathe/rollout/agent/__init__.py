"""Multi-turn, tool-calling rollouts (verl's agent loop, `actor_rollout_ref.rollout.multi_turn.*`).

- `loop.AgentLoop`: trajectories streamed through lathe's engine, tools in a bounded thread pool;
- `render.ConversationRenderer`: the chat template's tokens between model turns (no re-tokenisation);
- `parser`: tool calls in the model's text (`hermes`, `llama3_json`);
- `tools`: verl-shaped tools from a YAML file (`tools.BaseTool`, `tool_config.load_tools`) and lathe's built-in ones;
  `function_tools`: tools from a Python file of `@function_tool` functions.
"""

from __future__ import annotations

from lathe.batch import Batch

AGENT_SCORE = "agent_reward_score"      # a batch column: a custom agent loop's score of its sample (None: none)


def tool_config_path(cfg) -> str | None:
    """The run's tool file: `rollout.multi_turn.tool_config_path`, else verl's `data.tool_config_path`."""
    if not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return None
    return cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path or cfg.data.tool_config_path


def load_run_tools(cfg):
    """The run's `ToolSet`: the tool file's tools and the `@function_tool` functions of `multi_turn.
    function_tool_path` (`function_tools`), or None with neither."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return combined_tools(tool_config_path(cfg), mt.function_tool_path if mt.enable else None)


def combined_tools(path, functions, *, function_key: str | None = None):
    """The `ToolSet` of a tool file's tools (`path`) and a Python file's `@function_tool` functions (`functions`,
    named `function_key` in errors), a name in both refused; None with neither."""
    if not path and not functions:
        return None
    from lathe.rollout.agent.tool_config import load_tools
    from lathe.rollout.agent.tools import ToolConfigError, ToolSet
    tools = list(load_tools(path).tools.values()) if path else []
    if functions:
        from lathe.rollout.agent.function_tools import KEY, load_function_tools
        declared = {tool.name for tool in tools}
        added = load_function_tools(functions, key=function_key or KEY)
        clash = sorted(tool.name for tool in added if tool.name in declared)
        if clash:
            raise ToolConfigError(f"tools {clash} are declared both in {path} and as @function_tool functions in "
                                  f"{functions}. Fix: give each tool one name across the two")
        tools += added
    return ToolSet(tools)


def build_agent_loop(cfg, engine, tokenizer):
    """An `AgentLoop` over `engine` with the run's tools, simulated users, parser and `multi_turn` settings; the
    run's custom agent loops (`custom.CustomAgentLoops`) when `rollout.agent.agent_loop_config_path` is set."""
    from lathe.rollout.agent.custom import build_custom_loops, custom_loops_in
    if custom_loops_in(cfg.actor_rollout_ref.rollout):
        tools = load_run_tools(cfg)
        return build_custom_loops(cfg, engine, tokenizer, tools=list(tools.tools.values()) if tools else None)
    from lathe.rollout.agent.loop import AgentLoop, AgentSettings
    from lathe.rollout.agent.parser import get_parser
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    settings = AgentSettings.from_config(mt, cfg.data.max_response_length)
    interactions = None
    if mt.interaction_config_path:
        from lathe.rollout.agent.interactions import load_interactions
        interactions = load_interactions(mt.interaction_config_path, timeout_s=mt.tool_timeout)
    return AgentLoop(engine, tokenizer, settings, tools=load_run_tools(cfg), parse=get_parser(mt.format),
                     interactions=interactions)


ROW_FIELDS = ("raw_prompt", "data_source", "ability", "extra_info", "index", "uid", "agent_name")


def agent_kwargs(prompts: Batch, agent=None) -> dict:
    """What `AgentLoop.generate` reads of the prompt rows besides their tokens: each row's tools' `create_kwargs`
    (verl's `extra_info["tools_kwargs"]`), its simulated user's (`extra_info["interaction_kwargs"]`) and its chat
    messages (`raw_prompt`). For custom agent loops (an `agent` with `takes_rows`) also `rows`: each row's fields
    as verl's loops get them (`reward_model` holding the ground truth, `tools_kwargs`, `interaction_kwargs`)."""
    extra = prompts["extra_info"]
    out = {"tools_kwargs": [(x or {}).get("tools_kwargs") for x in extra],
           "interaction_kwargs": [(x or {}).get("interaction_kwargs") for x in extra],
           "messages": list(prompts["raw_prompt"])}
    if getattr(agent, "takes_rows", False):
        columns = {k: list(prompts[k]) for k in ROW_FIELDS if k in prompts}
        out["rows"] = [{**{k: v[i] for k, v in columns.items()},
                        "reward_model": {"ground_truth": prompts["ground_truth"][i], "style": "rule"},
                        "tools_kwargs": out["tools_kwargs"][i] or {},
                        "interaction_kwargs": out["interaction_kwargs"][i] or {}} for i in range(len(extra))]
    return out


def check_agent_names(prompts: Batch, rollout_cfg) -> None:
    """Rows naming verl's loops (`agent_name`) that this rollout (`actor_rollout_ref.rollout`) does not run: a custom
    loop's name without custom loops, `tool_agent` on a single-turn rollout (with custom loops their runner checks
    the names). From the config alone: every rank of a replica decides alike."""
    from lathe.rollout.agent.custom import custom_loops_in
    if "agent_name" not in prompts or custom_loops_in(rollout_cfg):
        return
    tools = rollout_cfg.multi_turn.enable
    builtin = {None, "single_turn_agent"} | ({"tool_agent"} if tools else set())
    bad = next(((i, n) for i, n in enumerate(prompts["agent_name"]) if n not in builtin), None)
    if bad is None:
        return
    index = prompts["index"][bad[0]] if "index" in prompts else bad[0]
    if bad[1] == "tool_agent":
        fix = "set actor_rollout_ref.rollout.multi_turn.enable=true (lathe's tool loop) with a tool file"
    else:
        fix = ("list the loop in actor_rollout_ref.rollout.agent.agent_loop_config_path (lathe.rollout.agent.custom), "
               "or drop the column")
    raise ValueError(f"prompt {index}: agent_name={bad[1]!r} names an agent loop this run does not have "
                     f"({'the tool loop' if tools else 'single-turn generation'} runs its rows). Fix: {fix}")


def agent_columns(out, extra_info: list) -> Batch:
    """Per-sample columns of a multi-turn rollout: verl's `num_turns`, tool calls/errors/seconds, and each sample's
    `extra_info` gaining `num_turns`, `tool_rewards` (each tool's `calc_reward`) and `turn_scores` (the simulated
    user's score of each turn) for the reward function."""
    fields = getattr(out, "extra_fields", None) or [{} for _ in out.num_turns]     # (a custom loop's own)
    extra = [{**(x or {}), **f, "num_turns": n, "tool_rewards": dict(r), "turn_scores": list(s)}
             for x, f, n, r, s in zip(extra_info, fields, out.num_turns, out.tool_rewards, out.turn_scores)]
    columns = {"num_turns": list(out.num_turns), "tool_calls": list(out.tool_calls),
               "tool_errors": list(out.tool_errors), "tool_seconds": list(out.tool_seconds), "extra_info": extra}
    scores = getattr(out, "reward_scores", None)
    if scores and any(x is not None for x in scores):      # a custom loop's own scores (`compute_reward` takes them)
        columns[AGENT_SCORE] = list(scores)
    return Batch(non_tensors=columns)
