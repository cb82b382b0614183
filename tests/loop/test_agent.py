"""The agent loop through `lathe train` (the task: the `agent_demo` preset, see tests/agent_task.py): a reward
reachable only through a tool rises under GRPO on CPU, as a tiny model warm-started on example conversations learns
to call the tool.

(Copying the secret into the final answer is beyond the built-in tiny model in a CPU test's budget: after 400
supervised steps it copied 13% of the time, as good as a guess; so the reward is the tool's verdict.)
"""

from __future__ import annotations

import pytest

from agent_task import agent_task, metric
from lathe.cli import main


@pytest.mark.slow
def test_the_model_learns_to_call_the_tool_and_its_reward_rises(tmp_path):
    steps = 10
    assert main(["train", *agent_task(), f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
                 f"trainer.default_local_dir={tmp_path}"]) == 0
    scores, calls = metric(tmp_path), metric(tmp_path, "agent/tool_calls/mean")
    assert len(metric(tmp_path, "val-core/lathe/secret_lookup/reward/mean@1")) == 1   # validation ran the loop too
    assert metric(tmp_path, "num_turns/max")[-1] == 4                      # prompt, call, answer, reply
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    # 0.14 -> 0.46 (tool calls alike) on the machine this was written on
    assert last >= first + 0.15, f"reward went from {first:.2f} to {last:.2f} in {steps} steps"
    assert sum(calls[-3:]) / 3 > sum(calls[:3]) / 3 + 0.15


@pytest.mark.slow
def test_lathe_train_agent_demo_runs_end_to_end(tmp_path, capsys):
    """The preset as a user runs it (warm start in `lathe train` included), cut to a few steps."""
    assert main(["train", "agent_demo", "trainer.total_training_steps=2", "trainer.test_freq=2",
                 "actor_rollout_ref.model.warm_start.steps=2", "actor_rollout_ref.model.warm_start.batch_size=8",
                 "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.rollout.n=2", "data.val_max_samples=2", "data.val_batch_size=2",
                 "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}"]) == 0
    assert len(metric(tmp_path, "agent/tool_calls/mean")) == 2 and len(metric(tmp_path, "num_turns/mean")) == 2
    assert len(metric(tmp_path, "val-core/lathe/secret_lookup/reward/mean@1")) == 2     # before training, at the end
    assert (tmp_path / "init_model" / "config.json").exists()                           # the warm-started start
    out = capsys.readouterr().out
    assert "step 2/2 | score" in out and "| tool_calls " in out


@pytest.mark.slow
def test_function_tools_serve_the_agent_demo_in_place_of_its_tool_file(tmp_path):
    """`multi_turn.function_tool_path` through `lathe train`: a file's @function_tool `f` (the built-in tool's
    schema) is the tool the demo's model calls, in place of builtin:secret_lookup."""
    log, tools = tmp_path / "calls.txt", tmp_path / "secret.py"
    tools.write_text("from lathe.rollout.agent.builtin_tools import SecretLookupTool\n"
                     "from lathe.rollout.agent.function_tools import function_tool\n\n\n"
                     "@function_tool(schema=SecretLookupTool.default_schema())\n"
                     "def f():\n"
                     f"    with open({str(log)!r}, 'a') as out:\n"
                     "        out.write('call\\n')\n"
                     "    return '7'\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    assert main(["train", *agent_task(), "trainer.total_training_steps=1", "trainer.test_freq=-1",
                 f"{mt}.tool_config_path=null", f"{mt}.function_tool_path={tools}",
                 f"trainer.default_local_dir={tmp_path / 'run'}"]) == 0
    calls = metric(tmp_path / "run", "agent/tool_calls/total")[0]
    ran = len(log.read_text().splitlines()) if log.exists() else 0
    assert 0 < ran <= calls, (ran, calls)          # 64 trajectories calling at ~0.14 each; bad calls do not run
