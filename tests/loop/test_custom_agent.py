"""`lathe train` with a custom agent loop (`rollout.agent.agent_loop_config_path`, lathe.rollout.agent.custom): the
loop, imported from the working directory by its `_target_`, gets each row's fields, generates from a prompt of its
own (a system message added), and its `reward_score` is the score the trainer uses."""

from __future__ import annotations

import json
import sys

import pytest

from loop.test_async_inprocess import ON_POLICY, in_process_pools  # noqa: F401
from lathe.cli import main

FAST = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=6", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console]", "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2"]

LOOP = '''
import json
from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput


class WithSystem(AgentLoopBase):
    def __init__(self, *args, log, score, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.score = log, score

    async def run(self, sampling_params, **kwargs):
        messages = [{"role": "system", "content": "Answer with digits."}] + list(kwargs["raw_prompt"])
        prompt = await self.ct_build_initial_tokens(messages)
        out = await self.server_manager.generate(request_id="a", prompt_ids=prompt, sampling_params=sampling_params)
        with open(self.log, "a") as f:
            f.write(json.dumps({"keys": sorted(kwargs), "gt": kwargs["reward_model"]["ground_truth"],
                                "longer": len(prompt) > len(kwargs["prompt_ids"]),
                                "budget": self.rollout_config.response_length}) + "\\n")
        n = self.rollout_config.response_length
        ids = out.token_ids[:n]
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids, response_mask=[1] * len(ids),
                               response_logprobs=out.log_probs[:n], reward_score=self.score, num_turns=2,
                               metrics={"generate_sequences": 0.0})
'''


def test_lathe_train_runs_a_custom_agent_loop_and_takes_its_scores(tmp_path, monkeypatch):
    log = tmp_path / "rows.jsonl"
    (tmp_path / "my_agent.py").write_text(LOOP)
    (tmp_path / "loops.yaml").write_text(f"- name: with_system\n  _target_: my_agent.WithSystem\n  log: {log}\n"
                                         "  score: 0.25\n")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    a = "actor_rollout_ref.rollout.agent"
    try:
        assert main(["train", *FAST, f"trainer.default_local_dir={run_dir}", f"{a}.default_agent_loop=with_system",
                     f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}"]) == 0
    finally:
        sys.modules.pop("my_agent", None)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 8                                     # 2 steps x 2 prompts x n=2
    assert all(r["longer"] and r["budget"] == 6 and r["gt"] for r in rows)
    assert {"raw_prompt", "data_source", "extra_info", "index", "reward_model", "prompt_ids", "uid"} <= set(
        rows[0]["keys"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["critic/score/mean"] == pytest.approx(0.25) and "timing_s/agent_loop" in m


TWO_TURNS = '''
from workers.test_lockstep_custom import Pause


class TwoTurns(Pause):
    """Pause's two turns around a tool answer; its score: the first token, odd or even."""

    async def run(self, sampling_params, **kwargs):
        out = await super().run(sampling_params, **kwargs)
        out.reward_score = float(out.response_ids[0] % 2)
        return out
'''


def test_on_policy_fully_async_custom_loops_equal_the_synchronous_run(tmp_path, monkeypatch, in_process_pools):
    """The loops on a rollout pool's replica (`CustomStream`: an event loop of their own, their turns added by the
    engine's thread) train as the synchronous run's, on-policy, validation included."""
    (tmp_path / "two_turns.py").write_text(TWO_TURNS)
    (tmp_path / "loops.yaml").write_text("- name: two\n  _target_: two_turns.TwoTurns\n")
    monkeypatch.chdir(tmp_path)
    a = "actor_rollout_ref.rollout.agent"
    keys = [*FAST, "data.max_response_length=48", f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}",
            f"{a}.default_agent_loop=two", "trainer.test_freq=2", "data.val_max_samples=4", "data.val_batch_size=4"]
    runs = []
    try:
        for name, extra in (("sync", []), ("async", ON_POLICY)):
            assert main(["train", *keys, *extra, f"trainer.default_local_dir={tmp_path / name}"]) == 0
            runs.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    finally:
        sys.modules.pop("two_turns", None)
    sync, on_policy = runs
    assert len(sync) == len(on_policy) == 2 and 0 < sync[0]["critic/score/mean"] < 1     # (a mixture of scores)
    assert sync[0]["actor/grad_norm"] > 0 and sync[0]["timing_s/agent_loop"] > 0
    for a_row, b_row in zip(sync, on_policy):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
                    *(k for k in a_row if k.startswith("val-"))):
            assert abs(a_row[key] - b_row[key]) <= 1e-4 * max(abs(a_row[key]), 1e-3), (key, a_row[key], b_row[key])
        assert b_row["fully_async/staleness/max"] == 0
