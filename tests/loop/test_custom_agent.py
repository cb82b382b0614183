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


SPANS_KEY = "training/off_policy/trajectory_spans/max"
TWO_TURNS = '''
from workers.test_lockstep_custom import Pause


class TwoTurns(Pause):
    """Pause's two turns around a tool answer; its score: the first token, odd or even."""

    async def run(self, sampling_params, **kwargs):
        out = await super().run(sampling_params, **kwargs)
        out.reward_score = float(out.response_ids[0] % 2)
        return out
'''


@pytest.mark.parametrize("mode", ["fully_async", "colocate_async"])
def test_on_policy_fully_async_custom_loops_equal_the_synchronous_run(tmp_path, monkeypatch, in_process_pools, mode):
    """The loops on a rollout pool's replica (`CustomStream`: an event loop of their own, their turns added by the
    engine's thread), or streamed on the trainer's own engine by colocate_async without warm-up batches, train as
    the synchronous run's, on-policy, validation included."""
    (tmp_path / "two_turns.py").write_text(TWO_TURNS)
    (tmp_path / "loops.yaml").write_text("- name: two\n  _target_: two_turns.TwoTurns\n")
    monkeypatch.chdir(tmp_path)
    a = "actor_rollout_ref.rollout.agent"
    keys = [*FAST, "data.max_response_length=48", f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}",
            f"{a}.default_agent_loop=two", "trainer.test_freq=2", "data.val_max_samples=4", "data.val_batch_size=4"]
    runs = []
    try:
        other = ON_POLICY if mode == "fully_async" else ["trainer.v1.trainer_mode=colocate_async",
                                                          "trainer.v1.colocate_async.num_warmup_batches=0"]
        for name, extra in (("sync", []), ("async", other)):
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
        if mode == "fully_async":
            assert b_row["fully_async/staleness/max"] == 0
        else:
            assert b_row[SPANS_KEY] == 1 and b_row["colocate_async/interrupted"] == 0


HELD = '''
import asyncio
import threading

from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput

STARTED, RELEASE = threading.Event(), threading.Event()


class Held(AgentLoopBase):
    """Turn 0 (6 tokens); a wait for the test's word (a tool that runs across a weight sync); a tool answer; turn 1
    (20 tokens, long enough for a sync to interrupt it). No log-probs returned: taken from the calls."""

    async def run(self, sampling_params, **kwargs):
        prompt = list(kwargs["prompt_ids"])
        params = {**sampling_params, "ignore_eos": True}
        first = await self.server_manager.generate(prompt_ids=prompt, sampling_params={**params, "max_tokens": 6})
        STARTED.set()
        await asyncio.get_running_loop().run_in_executor(None, RELEASE.wait, 60)
        ids, mask, _ = await self.ct_merge_assistant_token(prompt, first.token_ids, [], None)
        said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        ids, mask, _ = await self.ct_merge_non_assistant_msg(said, said + [{"role": "tool", "content": "7"}],
                                                             ids.token_ids, mask)
        second = await self.server_manager.generate(prompt_ids=ids.token_ids, sampling_params={**params,
                                                                                               "max_tokens": 20})
        ids, mask, _ = await self.ct_merge_assistant_token(ids.token_ids, second.token_ids, mask, None)
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids.token_ids[len(prompt):], response_mask=mask,
                               num_turns=4, metrics={})
'''


def test_syncs_during_a_loops_own_wait_and_during_its_turn_keep_each_tokens_version(tmp_path, monkeypatch):
    """One custom-loop sample on a fully-async replica (`CustomStream`): turn 0; the loop's own wait held until the
    replica has paused and loaded weights version 1; turn 1 interrupted a few tokens in by a second sync (version 2)
    and continued. Every token carries the version that sampled it and that version's log-prob (the loop returned
    none: they are its calls')."""
    import threading

    from lathe.batch import Batch
    from lathe.config import load_config
    from lathe.generation import SamplingParams
    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, load_tokenizer
    from lathe.workers.fully_async import RolloutWorker, request_agent
    from loop.test_async_agent import check_versions_and_logprobs, hold_mid_turn, two_syncs, versioned_weights

    (tmp_path / "held_loop.py").write_text(HELD)
    (tmp_path / "loops.yaml").write_text("- name: held\n  _target_: held_loop.Held\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a = "actor_rollout_ref.rollout.agent"
    cfg = load_config(None, ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                             "data.train_batch_size=0", "data.max_response_length=96",
                             f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}", f"{a}.default_agent_loop=held"])
    tokenizer = load_tokenizer("builtin:tiny")
    path, kwargs = _given_model(cfg, tokenizer)
    model = load_policy(path, **kwargs).double()
    model.save_pretrained(tmp_path / "model")
    weights = versioned_weights(model)
    mid_turn = threading.Event()
    try:
        worker = RolloutWorker(cfg, str(tmp_path / "model"), {"impl": "auto"}, tokenizer, device_type="cpu")
        import held_loop
        hold_mid_turn(worker, mid_turn)
        try:
            prompts = Batch(non_tensors={"prompt_ids": [tokenizer.encode("item 3")], "index": [0],
                                         "raw_prompt": [[{"role": "user", "content": "item 3"}]],
                                         "ground_truth": ["3"], "extra_info": [{}]})
            params = SamplingParams(n=1, temperature=1.0, max_tokens=96, seed=5)
            worker.submit([("r", [list(prompts["prompt_ids"][0])], params, 0, None, request_agent(prompts, True))])
            out = two_syncs(worker, weights, held_loop.STARTED, held_loop.RELEASE, mid_turn)
        finally:
            held_loop.RELEASE.set()
            worker.shutdown()
    finally:
        sys.modules.pop("held_loop", None)
    tool, turn_1, mask, versions, ids = check_versions_and_logprobs(out, model, weights)
    assert tool == 6 and len(ids) - turn_1 == 20                # the loop's turns, as it asked for them
