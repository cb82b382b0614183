"""The built-in agent task `builtin:secret_lookup`: each prompt's secret digit is known only to the tool `f`.

A row asks about an item ("item 17"); the digit the item hides is the row's ground truth and reaches the tool as
verl's `extra_info.tools_kwargs.f.create_kwargs.secret`. The built-in tool (`SecretLookupTool` of
`lathe.rollout.agent.builtin_tools`, tool config `builtin:secret_lookup`) answers it, and the built-in reward of
`data_source="lathe/secret_lookup"` is the tool's verdict: 1 once the trajectory has looked its secret up, else 0.
So the reward rises only as the policy learns to call the tool (`lathe train agent_demo`).

Each row's `extra_info.answer` is an example continuation for the supervised warm start: for a share of the rows
the model calls the tool, reads the digit and answers with it; for the others it answers a guess at once. It is a
list of messages (assistant turns trained, the tool's answer not), which `lathe sft` and
`actor_rollout_ref.model.warm_start` train as a conversation after the prompt.
"""

from __future__ import annotations

import json
import random
from typing import Any

SECRET_LOOKUP_DATA_SOURCE = "lathe/secret_lookup"   # lathe.reward.builtin scores it by the tool's verdict
TOOL_NAME = "f"                                     # short: the tiny model writes its call in a few dozen characters
TOOL_CALL = "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {}}) + "</tool_call>"   # hermes format
TOOL_SHARE = 0.4            # rows whose example continuation calls the tool: the warm start's tool-call rate


def secret_lookup_rows(n: int, seed: int, split: str, tool_share: float = TOOL_SHARE) -> list[dict[str, Any]]:
    """`n` rows in verl's schema, deterministic in `seed`; `tool_share` of their example continuations call `f`."""
    if n < 0 or not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"secret_lookup_rows: n={n} must be >= 0 and tool_share={tool_share} within [0, 1]")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        secret = str(rng.randrange(10))
        if rng.random() < tool_share:
            answer = [{"role": "assistant", "content": TOOL_CALL}, {"role": "tool", "content": secret},
                      {"role": "assistant", "content": "=" + secret}]
        else:
            answer = [{"role": "assistant", "content": "=" + str(rng.randrange(10))}]
        rows.append({
            "data_source": SECRET_LOOKUP_DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"item {i}"}],
            "ability": "tool_use",
            "reward_model": {"style": "rule", "ground_truth": secret},
            "extra_info": {"split": split, "index": i, "answer": answer,
                           "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"secret": secret}}}},
        })
    return rows

