"""The agent-loop task of tests/loop/test_agent.py and tests/cluster/test_agent_ray.py: the `agent_demo` preset.

Each prompt has a secret digit that only its tool `f` knows (verl's `tools_kwargs` in `extra_info`); the reward is
the tool's own verdict (`calc_reward`, as verl's GSM8K tool scores an answer), reaching the built-in reward through
`extra_info["tool_rewards"]`: 1 once the trajectory has looked its secret up, else 0. All of it is built in
(`builtin:secret_lookup`: data, tool config and reward; `lathe.data.secret_lookup`), and so is the supervised warm
start on example conversations (40% of them call the tool): the first run of the session computes it, the others
read it from the session's warm-start cache (tests/conftest.py). The tool class is a module of lathe's, so Ray
workers import it too.
"""

from __future__ import annotations

import json
from pathlib import Path

AGENT_TASK = ("agent_demo", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[console]")


def agent_task() -> tuple[str, ...]:
    """`lathe train` arguments of the `agent_demo` preset."""
    return AGENT_TASK


def metric(run_dir, key: str = "critic/score/mean") -> list[float]:
    """`key` at each step of a run's metrics.jsonl that has it."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]
