"""Multi-turn agent loops in fully-async training (both pools in this process: tests/loop/test_async_inprocess.py).

The task is the `agent_demo` preset's (`builtin:secret_lookup`: the tool `f` knows each prompt's secret, the reward is
its verdict) on the untrained tiny model, whose text never holds a well-formed call: the tests' parser calls `f` from
every turn whose text has an even number of characters, so some trajectories call it (once or twice) and some do
not, and their rewards differ. A replica's trajectory keeps its turns' tokens, log-probs and weight versions across
a sync that comes while its tool call runs, and across one that interrupts a turn."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch

from loop.test_async_inprocess import ON_POLICY, in_process_pools  # noqa: F401
from lathe.batch import Batch
from lathe.cli import main
from lathe.rollout.agent.parser import ParsedTurn, ToolCall

AGENT = ["agent_demo", "actor_rollout_ref.model.warm_start.steps=0", "data.train_batch_size=2",
         "data.max_response_length=64", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "trainer.total_training_steps=2",
         "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[console]"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "agent/tool_calls/mean",
            "num_turns/mean")


def even_calls(text: str) -> ParsedTurn:
    """A parser that calls `f` (no arguments) from every turn whose text has an even number of characters."""
    return ParsedTurn(text, [ToolCall("f", {})] if len(text) % 2 == 0 else [])


@pytest.fixture
def forced_calls(monkeypatch):
    import lathe.rollout.agent.parser as parser
    monkeypatch.setattr(parser, "get_parser", lambda fmt: even_calls)


def train(run_dir, *overrides: str) -> list[dict]:
    assert main(["train", *AGENT, f"trainer.default_local_dir={run_dir}", *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_on_policy_async_multi_turn_equals_the_synchronous_loop(tmp_path, in_process_pools, forced_calls):
    val = ["trainer.test_freq=2", "data.val_max_samples=4", "data.val_batch_size=4"]     # (the replica's, in async)
    sync = train(tmp_path / "sync", *val)
    on_policy = train(tmp_path / "async", *ON_POLICY, *val)
    assert len(sync) == len(on_policy) == 2
    assert 0 < sync[0]["agent/tool_calls/mean"] and 0 < sync[0]["critic/score/mean"] < 1, "precondition: a mixture"
    assert "val-core/lathe/secret_lookup/reward/mean@1" in on_policy[-1]
    for a, b in zip(sync, on_policy):
        for key in (*COMPARED, *(k for k in a if k.startswith("val-"))):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
        assert b["fully_async/staleness/max"] == 0


def test_off_policy_multi_turn_stays_within_the_staleness_bound_and_resumes_each_prompt_once(
        tmp_path, in_process_pools, forced_calls):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    args = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false", "data.train_batch_size=0",
            "data.gen_batch_size=1", "trainer.total_training_steps=4", "async_training.staleness_threshold=0.5",
            "async_training.trigger_parameter_sync_step=2", "async_training.require_batches=1",
            "async_training.partial_rollout=true", "trainer.save_freq=2", f"trainer.rollout_data_dir={dumps}"]
    rows = train(run, *args)
    assert [r["fully_async/policy_version"] for r in rows] == [0, 0, 1, 1]
    stale = [r["fully_async/count/stale_samples_processed"] for r in rows]
    assert stale[1] == 0 and stale[3] - stale[1] <= math.floor(0.5 * 4), stale      # 4 prompts per sync
    for r in rows:
        assert r["fully_async/staleness/max"] <= 1 + r["fully_async/partial/max_partial_span"], r
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm"))
    assert sum(r["agent/tool_calls/mean"] for r in rows) > 0
    # resumed from step 2: steps 3 and 4 again; over steps 1-4 no prompt is trained twice or in part
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(run, *args)
    assert len(resumed) == 4 and [r["fully_async/policy_version"] for r in resumed[2:]] == [1, 1]
    trained = [json.loads(line)["uid"] for step in range(1, 5)
               for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert len(trained) == 4 * 2 * 4 and all(trained.count(u) == 4 for u in set(trained)), trained


def versioned_weights(model) -> list[dict]:
    """Weights versions 0, 1, 2 of `model` (its lm_head scaled)."""
    return [{name: t * scale if name == "lm_head.weight" else t for name, t in model.state_dict().items()}
            for scale in (1.0, 1.5, 0.7)]


def hold_mid_turn(worker, mid_turn: threading.Event) -> None:
    """The 4th engine step under weights version 1 sets `mid_turn` and waits for the driver's pause: it comes in the
    middle of a turn."""
    step, steps = worker.engine.step, [0]

    def step_then_hold():
        out = step()
        if worker.engine.weight_version == 1:
            steps[0] += 1
            if steps[0] == 4:
                mid_turn.set()
                while not worker._hold:
                    time.sleep(0.005)
        return out

    worker.engine.step = step_then_hold


def two_syncs(worker, weights, started: threading.Event, release: threading.Event, mid_turn: threading.Event):
    """Request "r" on `worker`: when turn 0 is done (`started`) a sync to version 1 while the trajectory waits off
    the engine, then `release` it; a sync to version 2 in the middle of turn 1 (`hold_mid_turn`). Its batch."""
    assert started.wait(60), "turn 0 ran"
    assert worker.pause(partial=True, timeout_s=60) == 0           # no turn in progress: the wait runs on
    worker.engine.load_weights([(k, v.float()) for k, v in weights[1].items()], version=1)
    release.set()
    worker.resume()
    assert mid_turn.wait(60), "turn 1 ran 4 engine steps"
    assert worker.pause(partial=True, timeout_s=60) == 1           # turn 1 interrupted
    worker.engine.load_weights([(k, v.float()) for k, v in weights[2].items()], version=2)
    worker.resume()
    return collect_one(worker, "r")


def collect_one(worker, key, timeout_s: float = 60):
    got = {}
    deadline = time.monotonic() + timeout_s
    while key not in got and time.monotonic() < deadline:
        got.update(worker.collect(wait_s=0.5)["done"])
    return got[key]


def check_versions_and_logprobs(out, model, weights):
    """A one-sample request's batch: the first appended token, where the last turn starts, and that every model
    token's log-prob is the one its version gives (teacher-forced, float64). Returns (tool, turn_1, mask, versions,
    ids)."""
    length = int(out["attention_mask"][0].sum()) - out["prompts"].shape[1]
    mask, versions = out["response_mask"][0, :length].bool(), out["rollout_versions"][0, :length]
    ids = out["responses"][0, :length]
    tool = int((~mask).nonzero()[0])                            # the first appended token
    turn_1 = tool + int(mask[tool:].nonzero()[0])
    assert mask[turn_1:].all() and not mask[tool:turn_1].any()
    assert (versions[:turn_1] == 0).all() and versions[turn_1] == 1 and versions[-1] == 2
    assert (versions[turn_1:].diff() >= 0).all()
    prompt = out["prompts"][0][out["attention_mask"][0, :out["prompts"].shape[1]].bool()]
    seq = torch.cat([prompt, ids])[None]
    got_lp = out["rollout_log_probs"][0, :length].double()
    for version in (0, 1, 2):
        model.load_state_dict(weights[version])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        mine = mask & (versions == version)
        assert mine.any() and (want - got_lp)[mine].norm() <= 1e-4 * want[mine].norm(), (version, want, got_lp)
    return tool, turn_1, mask, versions, ids


def test_syncs_during_a_tool_call_and_during_a_turn_keep_the_answer_and_each_tokens_version(tmp_path, monkeypatch):
    """One trajectory on a replica: turn 0; a call of `f` held until the replica has paused and loaded weights
    version 1; the answer appended; turn 1 interrupted a few tokens in by a second sync (version 2) and continued.
    Every token carries the version that sampled it and that version's log-prob."""
    from lathe.config import load_config
    from lathe.generation import SamplingParams
    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, load_tokenizer
    from lathe.rollout.agent import builtin_tools, parser
    from lathe.workers.fully_async import RolloutWorker, request_agent

    monkeypatch.setattr(parser, "get_parser", lambda fmt: lambda text: ParsedTurn(text, [ToolCall("f", {})]))
    started, release, mid_turn = threading.Event(), threading.Event(), threading.Event()
    execute = builtin_tools.SecretLookupTool.execute

    def held(self, *args, **kwargs):
        started.set()
        assert release.wait(60)
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(builtin_tools.SecretLookupTool, "execute", held)
    cfg = load_config("agent_demo", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                     "data.train_batch_size=0",
                                     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"])
    tokenizer = load_tokenizer("builtin:tiny")
    path, kwargs = _given_model(cfg, tokenizer)
    model = load_policy(path, **kwargs).double()
    model.save_pretrained(tmp_path / "model")
    weights = versioned_weights(model)
    worker = RolloutWorker(cfg, str(tmp_path / "model"), {"impl": "auto"}, tokenizer, device_type="cpu")
    hold_mid_turn(worker, mid_turn)
    try:
        prompts = Batch(non_tensors={"prompt_ids": [tokenizer.encode("item 3")],
                                     "raw_prompt": [[{"role": "user", "content": "item 3"}]],
                                     "extra_info": [{"tools_kwargs": {"f": {"create_kwargs": {"secret": "7"}}}}]})
        params = SamplingParams(n=1, temperature=1.0, max_tokens=96, seed=5)
        worker.submit([("r", [list(prompts["prompt_ids"][0])], params, 0, None, request_agent(prompts))])
        out = two_syncs(worker, weights, started, release, mid_turn)
    finally:
        release.set()
        worker.shutdown()
    tool, turn_1, mask, versions, ids = check_versions_and_logprobs(out, model, weights)
    assert out["num_turns"] == [4] and out["tool_calls"] == [1]          # prompt, turn 0, the answer, turn 1
    assert out["extra_info"][0]["tool_rewards"] == {"f": 1.0}             # the call ran and was kept
    assert "7" in tokenizer.decode(ids[tool:turn_1].tolist())             # its answer is in the trajectory
