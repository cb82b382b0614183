"""The agent-loop task of tests/loop/test_agent.py and tests/cluster/test_agent_ray.py: the `agent_demo` preset.

Each prompt has a secret digit that only its tool `f` knows (verl's `tools_kwargs` in `extra_info`); the reward is
the tool's own verdict (`calc_reward`, as verl's GSM8K tool scores an answer), reaching the built-in reward through
`extra_info["tool_rewards"]`: 1 once the trajectory has looked its secret up, else 0. All of it is built in
(`builtin:secret_lookup`: data, tool config and reward; `lathe.data.secret_lookup`). `agent_task()` warm-starts
the built-in tiny model once per test session, as the preset does (example conversations, 40% of them call the
tool), and returns the `lathe train` arguments that run the preset from it. The tool class is a module of lathe's,
so Ray workers import it too.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import warm_started

def agent_task() -> tuple[str, ...]:
    """`lathe train` arguments of the `agent_demo` preset from its warm-started model (built once per test session)."""
    return ("agent_demo", *warm_started(None, "agent_demo"), "trainer.val_before_train=false",
            "trainer.logger=[console]")


def metric(run_dir, key: str = "critic/score/mean") -> list[float]:
    """`key` at each step of a run's metrics.jsonl that has it."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]
