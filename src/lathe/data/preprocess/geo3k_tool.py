"""Geometry3K for multi-turn tool use -> verl parquet with images, in the layout of verl's
examples/data_preprocess/geo3k_multiturn_w_tool.py (`lathe preprocess geo3k_tool`).

The rows are geo3k.py's (the problem + INSTRUCTION user message with its `<image>` placeholders, the `images`
passed through, data_source "hiyouga/geometry3k", ability "math", reward_model ground_truth, extra_info
{split, index, answer, question}) with
- a system message first, telling the model to check its answer with the `calc_geo3k_reward` tool
  (`lathe.rollout.agent.builtin_tools.Geo3kTool`, examples/tools/geo3k_tool.yaml) before its final answer;
- extra_info.need_tools_kwargs = True and extra_info.tools_kwargs = {"calc_geo3k_reward": {"create_kwargs":
  {"ground_truth": <the answer>}}}: the agent loop creates each trajectory's tool instance with them, so the tool
  scores submissions against this row's answer.
verl's rows also carry agent_name "tool_agent" (verl's agent-loop registry); lathe runs its tool loop for every row
when rollout.multi_turn.enable=true, so it is left out (a row's agent_name picks a custom agent loop in lathe, and
"tool_agent" rows are refused on a single-turn run).
"""

from __future__ import annotations

from lathe.data.preprocess.common import with_answer_tool
from lathe.data.preprocess.geo3k import geo3k_row, preprocess_geo3k

TOOL_NAME = "calc_geo3k_reward"
SYSTEM_PROMPT = (
    "You are a careful geometry solver. Read the diagram and work through the question step by step before you "
    f"call any tool. Once you have an answer, submit it to the `{TOOL_NAME}` tool at least once to check it, and "
    "revise your work if the check fails. Then give the final answer."
)


def geo3k_tool_row(problem: str, answer: str, images: list, split: str, index: int) -> dict:
    """One verl-schema row for the multi-turn tool recipe: geo3k_row plus the system message and tools_kwargs."""
    return with_answer_tool(geo3k_row(problem, answer, images, split, index), TOOL_NAME, SYSTEM_PROMPT, answer)


def preprocess_geo3k_tool(input: str, output_dir: str) -> dict[str, str]:
    """Convert a local hiyouga/geometry3k copy to the tool recipe's `<output_dir>/{train,test}.parquet`; returns
    {split: path}."""
    return preprocess_geo3k(input, output_dir, row_fn=geo3k_tool_row)
