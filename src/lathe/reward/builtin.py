"""Scorers of lathe's built-in tasks.

* ``data_source="lathe/arithmetic"``: the task asks for a bare answer (``"12 + 30 ="`` -> ``"42"``), so the check
  is an exact match after stripping surrounding whitespace on both sides. The caller has already removed special
  tokens (EOS, padding) from the decoded response.
* ``data_source="lathe/secret_lookup"`` (the agent task, `lathe.data.secret_lookup`): the verdict of the lookup tool
  ``f`` (its ``calc_reward``, which the agent loop passes in ``extra_info["tool_rewards"]``): 1.0 once the trajectory
  has looked its secret up, else 0.0, whatever the answer says.
"""

from __future__ import annotations

__all__ = ["SECRET_LOOKUP_SOURCES", "compute_score", "tool_verdict"]

SECRET_LOOKUP_SOURCES = frozenset({"lathe/secret_lookup"})   # lathe.data.secret_lookup's data_source
SECRET_LOOKUP_TOOL = "f"                                      # and its tool's name


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """1.0 when ``solution_str.strip() == str(ground_truth).strip()``, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def tool_verdict(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The secret-lookup tool's verdict on the trajectory, from ``extra_info["tool_rewards"]`` (0.0 if it never
    called the tool). Without ``tool_rewards`` (a single-turn rollout) there is no verdict: ValueError with the fix."""
    rewards = (extra_info or {}).get("tool_rewards")
    if rewards is None:
        raise ValueError("data_source lathe/secret_lookup is scored by its tool's verdict, which only the multi-turn "
                         "agent loop gives (extra_info has no tool_rewards). Fix: set actor_rollout_ref.rollout."
                         "multi_turn.enable=true and actor_rollout_ref.rollout.multi_turn.tool_config_path="
                         "builtin:secret_lookup (the agent_demo preset does)")
    return float(rewards.get(SECRET_LOOKUP_TOOL, 0.0))
