"""GSM8K for multi-turn tool use -> verl parquet, in the layout of verl's
examples/data_preprocess/gsm8k_multiturn_w_tool.py (`lathe preprocess gsm8k_tool`).

The rows are gsm8k.py's (same question + INSTRUCTION user message, data_source "openai/gsm8k", ability "math",
reward_model ground_truth, extra_info {split, index, answer, question}) with
- a system message first, telling the model to check its answer with the `calc_gsm8k_reward` tool
  (`lathe.rollout.agent.builtin_tools.Gsm8kTool`, examples/tools/gsm8k_tool.yaml) before it writes "#### <answer>";
- extra_info.need_tools_kwargs = True and extra_info.tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs":
  {"ground_truth": <the number>}}}: the agent loop creates each trajectory's tool instance with them, so the tool
  scores submissions against this row's answer.
verl's rows also carry extra_info.interaction_kwargs (for simulated users); lathe has no interactions, so it is left
out.
"""

from __future__ import annotations

from lathe.data.preprocess.common import with_answer_tool
from lathe.data.preprocess.gsm8k import gsm8k_row, preprocess_gsm8k

TOOL_NAME = "calc_gsm8k_reward"
SYSTEM_PROMPT = (
    "You are a careful math solver. Work through the question step by step before you call any tool. "
    f"Once you have an answer, submit it to the `{TOOL_NAME}` tool at least once to check it, and revise your "
    "work if the check fails. End your reply with the final answer on its own line, written as `#### <answer>`."
)


def gsm8k_tool_row(question: str, answer: str, split: str, index: int, ground_truth: str) -> dict:
    """One verl-schema row for the multi-turn tool recipe: gsm8k_row plus the system message and tools_kwargs."""
    return with_answer_tool(gsm8k_row(question, answer, split, index, ground_truth), TOOL_NAME, SYSTEM_PROMPT, ground_truth)


def preprocess_gsm8k_tool(input: str, output_dir: str) -> dict[str, str]:
    """Convert raw GSM8K (a folder with train.jsonl/test.jsonl, or one .jsonl) to the tool recipe's parquet.

    Writes `<output_dir>/<split>.parquet` for each split found; returns {split: path}.
    """
    return preprocess_gsm8k(input, output_dir, row_fn=gsm8k_tool_row)
