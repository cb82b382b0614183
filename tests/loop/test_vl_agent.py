"""The agent loop with a vision-language policy through `lathe train` (verl's geo3k multi-turn recipe in miniature):
GRPO on the tiny Qwen2.5-VL checkpoint's colour-image prompts, with the built-in calculator tool from a tool file.
The random model writes no tool calls of its own, so the parser is made to read one in every turn; the tool then
really runs, its answer is appended as the template renders it, and the next turn goes on from the image prompt."""

import math

import torch

from lathe.rollout.agent import parser as parser_module
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from .test_ppo import read_metrics, run
from .test_vl_train import COLOURS, vl_keys

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
TOOLS = """tools:
  - class_name: lathe.rollout.agent.builtin_tools.CalculatorTool
    config: {type: native}
"""


def force_calls(monkeypatch) -> None:
    """The parser reads CALL in every turn (the random model writes no tool calls of its own)."""
    real = parser_module.get_parser

    def forced(name):
        parse = real(name)
        return lambda text: parse(CALL)
    monkeypatch.setattr(parser_module, "get_parser", forced)


def agent_keys(tmp_path) -> list[str]:
    """The geo3k-style VL multi-turn run's keys: two steps, the calculator from a tool file, two assistant turns."""
    (tmp_path / "tools.yaml").write_text(TOOLS)
    return [*vl_keys(tmp_path, "(sum(map(ord, solution_str)) % 5) / 4", response_length=96),
            "trainer.total_training_steps=2", "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]


def test_multi_turn_grpo_on_image_prompts_calls_the_tool_and_trains(tmp_path, monkeypatch):
    force_calls(monkeypatch)
    batches = []
    generate = ActorRolloutRefWorker.generate_sequences

    def spy(self, prompts, params, **kw):
        batches.append(generate(self, prompts, params, **kw))
        return batches[-1]
    monkeypatch.setattr(ActorRolloutRefWorker, "generate_sequences", spy)
    run(tmp_path, *agent_keys(tmp_path))
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["agent/tool_calls/total"] >= 1 and m["num_turns/max"] == 4     # prompt, call, answer, reply
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"))
        assert m["agent/prefix_hit_rate"] > 0.5
    batch = batches[-1]
    mask, attention = batch["response_mask"], batch["attention_mask"][:, -batch["responses"].shape[1]:]
    assert bool(((attention == 1) & (mask == 0)).any()), "the tool answers are in the response, out of the loss"
    assert any("42" in text for text in batch["response_text"]), "the calculator's answer reached the conversation"
    prompt_len = batch["prompts"].shape[1]
    for i in range(len(batch)):                 # every row carries its own prompt's image
        image = batch["multi_modal_data"][i]["image"][0].convert("RGB").getpixel((0, 0))
        assert image == COLOURS[int(batch["ground_truth"][i])], i
        grid = batch["multi_modal_inputs"][i]["image_grid_thw"]
        placeholders = int((batch["input_ids"][i, :prompt_len] == _image_token(tmp_path)).sum())
        assert placeholders == int(grid.prod(-1).sum()) // 4, i


def _image_token(tmp_path) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(tmp_path / "model").image_token_id


def test_a_tool_that_answers_with_an_image_stops_the_run_naming_it():
    from lathe.rollout.agent.parser import ToolCall
    from lathe.rollout.agent.tools import BaseTool, ToolImageError, ToolResponse, ToolSet

    class Crop(BaseTool):
        def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="cropped", image=[torch.zeros(3, 4, 4)]), 0.0, {}

    schema = {"type": "function", "function": {"name": "crop", "description": "crop",
                                               "parameters": {"type": "object", "properties": {}}}}
    session = ToolSet([Crop(tool_schema=schema)]).open("t0")
    try:
        session.call(ToolCall("crop", {}), timeout_s=5)
    except ToolImageError as e:
        assert "'crop'" in str(e) and "ToolResponse.image" in str(e) and "Fix:" in str(e)
    else:
        raise AssertionError("an image in a tool answer was dropped silently")


def test_on_policy_async_multi_turn_on_image_prompts_equals_the_synchronous_loop(tmp_path, monkeypatch):
    """The same run on a rollout pool of its own (both pools in this process, on-policy): each request's images reach
    its trajectories on the replica, prepared once for all their turns, and the run samples, scores and updates as
    the synchronous loop does."""
    from loop.test_async_inprocess import ON_POLICY, start_in_process
    import lathe.cluster
    force_calls(monkeypatch)
    keys = [*agent_keys(tmp_path), "data.train_batch_size=2"]      # one mini-batch a step, as on-policy async steps
    run(tmp_path, *keys, name="sync")
    monkeypatch.setattr(lathe.cluster, "start_async_cluster", start_in_process)
    run(tmp_path, *keys, *ON_POLICY, name="async")
    sync, on_policy = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert sorted(sync) == sorted(on_policy) == [1, 2]
    for step in (1, 2):
        a, b = sync[step], on_policy[step]
        assert b["agent/tool_calls/total"] >= 1 and b["num_turns/max"] == 4
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
                    "agent/tool_calls/mean", "num_turns/mean"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (step, key, a[key], b[key])
