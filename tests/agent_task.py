"""The agent-loop task of tests/loop/test_agent.py and tests/cluster/test_agent_ray.py, warm-started once per session.

Each prompt has a secret digit that only its tool `f` knows (verl's `tools_kwargs` in `extra_info`). The reward is the
tool's own verdict (`calc_reward`, as verl's GSM8K tool scores an answer), reaching the reward function through
`extra_info["tool_rewards"]`: 1 once the trajectory has looked its secret up, else 0. `agent_task()` writes the
task, warm-starts the built-in tiny model with `lathe sft` on example conversations (40% call the tool, the rest
answer straight away) and returns the `lathe train` overrides that run it. The tool is named by file path, so Ray
workers import it too.
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

TOOL_CODE = '''
from lathe.rollout.agent.tools import BaseTool, ToolResponse


class Lookup(BaseTool):
    """Answers the secret digit its trajectory was created with (create_kwargs)."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.values = {}

    def create(self, instance_id=None, value="?", **kwargs):
        self.values[instance_id] = value
        return instance_id, ToolResponse()

    def execute(self, instance_id, parameters, **kwargs):
        self.values[instance_id] += "!"
        return ToolResponse(text=self.values[instance_id][0]), 0.0, {}

    def calc_reward(self, instance_id, **kwargs):
        return float(self.values[instance_id].endswith("!"))

    def release(self, instance_id, **kwargs):
        self.values.pop(instance_id, None)
'''
TOOLS_YAML = '''
tools:
  - class_name: {root}/agent_tools.py:Lookup
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: f
        description: the secret digit
        parameters: {type: object, properties: {}, required: []}
'''
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return extra_info["tool_rewards"].get("f", 0.0)
'''
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def write_task(root, n_sft: int = 256, n_rl: int = 512, tool_share: float = 0.4):
    rng = random.Random(0)
    (root / "agent_tools.py").write_text(TOOL_CODE)
    (root / "tools.yaml").write_text(TOOLS_YAML.replace("{root}", str(root)))
    (root / "reward.py").write_text(REWARD)
    with open(root / "sft.jsonl", "w") as f:
        for i in range(n_sft):
            secret, user = str(rng.randrange(10)), {"role": "user", "content": f"item {i}"}
            if rng.random() < tool_share:
                conv = [user, {"role": "assistant", "content": CALL}, {"role": "tool", "content": secret},
                        {"role": "assistant", "content": "=" + secret}]
            else:
                conv = [user, {"role": "assistant", "content": "=" + str(rng.randrange(10))}]
            f.write(json.dumps({"messages": conv}) + "\n")
    with open(root / "rl.jsonl", "w") as f, open(root / "val.jsonl", "w") as v:
        for i in range(n_rl):
            secret = str(rng.randrange(10))
            row = json.dumps({"data_source": "secret", "prompt": [{"role": "user", "content": f"item {i}"}],
                              "reward_model": {"ground_truth": secret},
                              "extra_info": {"tools_kwargs": {"f": {"create_kwargs": {"value": secret}}}}}) + "\n"
            f.write(row)
            if i < 16:
                v.write(row)


def scores_of(run_dir, key="critic/score/mean") -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


SFT_STEPS = 60


@functools.lru_cache(maxsize=None)
def agent_task() -> tuple[str, ...]:
    """`lathe train` overrides for the task, from the warm-started model (built once per test session)."""
    from lathe.cli import main
    root = Path(tempfile.mkdtemp(prefix="lathe-agent-task-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_task(root)
    assert main(["sft", f"data.train_files={root / 'sft.jsonl'}", "data.val_files=null", "data.train_batch_size=32",
                 "data.micro_batch_size_per_gpu=32", "optim.lr=3e-3", f"trainer.total_training_steps={SFT_STEPS}",
                 "trainer.logger=[console]", f"trainer.default_local_dir={root / 'sft'}"]) == 0
    model = root / "sft" / f"global_step_{SFT_STEPS}" / "actor" / "huggingface"
    return (f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'rl.jsonl'}",
            f"data.val_files={root / 'val.jsonl'}", "data.val_batch_size=16", "data.train_batch_size=8",
            "data.max_prompt_length=32", "data.max_response_length=96", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.model.warm_start.steps=0", "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={root / 'tools.yaml'}",
            f"reward.custom_reward_function.path={root / 'reward.py'}", "trainer.val_before_train=false",
            "trainer.logger=[console]")


def metric(run_dir, key: str = "critic/score/mean") -> list[float]:
    """`key` at each step of a run's metrics.jsonl that has it."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]
