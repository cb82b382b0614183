"""Custom agent loops (`lathe.rollout.agent.custom`) on a tensor-parallel replica (`lathe.workers.lockstep`): a leader
and a follower over gloo (two processes) run a two-turn loop that waits a random time between its turns (another on
every rank) on a tiny random model; the leader's output is the one-process run's, token for token, greedy and
seeded, the loop runs on the leader only, and both ranks' engines take the same requests at the same steps."""

from __future__ import annotations

import asyncio
import os
import random
import tempfile

import pytest
import torch

from helpers import forkserver_ranks, gloo_rank, qwen_style_tokenizer
from lathe.generation import SamplingParams
from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput, CustomAgentLoops
from lathe.workers.lockstep import ReplicaEngine
from rollout.agent.test_loop import tiny_model
from workers.test_lockstep_agent import engine_of, started_rollout, tp_replica
from rollout.agent.test_render import rendered

JOIN_S = 60
QUESTIONS = ("What is 6*7?", "1+2=", "hi")
SAMPLINGS = {"greedy": dict(do_sample=False), "seeded": dict(temperature=1.0, seed=11)}
RUNS: list[int] = []                # this process's loop runs


class Pause(AgentLoopBase):
    """A turn, a random pause and a fixed tool answer (as the chat template renders it), a second turn."""

    async def run(self, sampling_params, **kwargs):
        RUNS.append(kwargs["index"])
        prompt = list(kwargs["prompt_ids"])
        first = await self.server_manager.generate(prompt_ids=prompt, sampling_params={**sampling_params,
                                                                                      "max_tokens": 12})
        ids, mask, lp = await self.ct_merge_assistant_token(prompt, first.token_ids, [], [], first.log_probs)
        await asyncio.sleep(random.uniform(0.0, 0.05))
        said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
        ids, mask, lp = await self.ct_merge_non_assistant_msg(said, said + [{"role": "tool", "content": "9"}],
                                                              ids.token_ids, mask, lp)
        second = await self.server_manager.generate(prompt_ids=ids.token_ids, sampling_params=sampling_params)
        ids, mask, lp = await self.ct_merge_assistant_token(ids.token_ids, second.token_ids, mask, lp,
                                                            second.log_probs)
        n = self.rollout_config.response_length
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids.token_ids[len(prompt):][:n], response_mask=mask[:n],
                               response_logprobs=lp[:n], num_turns=4, metrics={})


def run_case(engine, tok, sampling: str):
    from lathe.config import load_config
    cfg = load_config(None, ["data.max_response_length=40", "data.max_prompt_length=512"])
    runner = CustomAgentLoops(engine, tok, cfg, registry={"pause": (Pause, {})}, default="pause",
                              response_length=40, prompt_length=512, timeout_s=JOIN_S)
    prompts = [rendered(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    rows = [{"raw_prompt": [{"role": "user", "content": q}], "index": i} for i, q in enumerate(QUESTIONS)]
    out = runner.generate(prompts, SamplingParams(n=2, max_tokens=40, **SAMPLINGS[sampling]), first_index=4,
                          rows=rows)
    return {"tokens": out.token_ids, "masks": out.loss_masks, "finish": out.finish_reasons, "logprobs": out.logprobs}


def custom_rollout(tp: int, where: str):
    """The synchronous loop's `Rollout` (`lathe.workers.rollout`) of a TP=`tp` replica running `Pause` (listed in a
    YAML file at `where`) on two prompts of the built-in tiny policy: its samples' responses and masks (None on a
    follower)."""
    from lathe.batch import Batch
    from lathe.config import load_config
    from lathe.models.hf import load_tokenizer
    with open(where, "w") as f:
        f.write(f"- name: pause\n  _target_: {__name__}.Pause\n")
    R = "actor_rollout_ref.rollout"
    cfg = load_config(None, [f"trainer.n_gpus_per_node={tp}", f"{R}.tensor_model_parallel_size={tp}",
                             f"{R}.agent.agent_loop_config_path={where}", f"{R}.agent.default_agent_loop=pause",
                             "data.max_response_length=40"], device_count=tp)
    tok = load_tokenizer("builtin:tiny")
    rollout = started_rollout(cfg, tok)
    items = ("item 3", "item 5")
    prompts = Batch(non_tensors={"prompt_ids": [tok.encode(x) for x in items], "index": [0, 1],
                                 "raw_prompt": [[{"role": "user", "content": x}] for x in items],
                                 "ground_truth": ["3", "5"], "extra_info": [{}, {}]})
    batch = rollout.generate_sequences(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=5))
    if batch is None:
        return None
    return [row[m.bool()].tolist() for row, m in zip(batch["responses"], batch["response_mask"])], \
        batch["response_mask"].tolist()


def rank_body(rank: int, port: int):
    tok = qwen_style_tokenizer()
    replica, _, log = tp_replica(tok)        # (the pauses differ between the ranks)
    results = {}
    for sampling in SAMPLINGS:
        RUNS.clear()
        out = replica.run(lambda: run_case(ReplicaEngine(replica), tok, sampling))
        results[sampling] = (out, sorted(RUNS))
    where = os.path.join(tempfile.gettempdir(), f"lathe-custom-{port}-{rank}.yaml")
    try:
        return {"results": results, "log": log, "rollout": custom_rollout(2, where)}
    finally:
        os.remove(where)


def rank_main(rank: int, port: int, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: rank_body(rank, port), JOIN_S)


@pytest.fixture(scope="module")
def ranks() -> dict:
    return forkserver_ranks(__name__, rank_main, 2, 3 * JOIN_S)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_the_replica_runs_the_samples_one_process_runs(ranks, sampling):
    tok = qwen_style_tokenizer()
    want = run_case(engine_of(tiny_model(tok), tok), tok, sampling)
    got, runs = ranks[0]["results"][sampling]
    assert all(0 in m for m in want["masks"])                         # two turns around a tool answer
    for key in ("tokens", "masks", "finish"):
        assert got[key] == want[key], key
    a, b = torch.tensor(sum(got["logprobs"], [])), torch.tensor(sum(want["logprobs"], []))
    assert (a - b).norm() <= 1e-4 * b.norm()
    assert runs == [0, 0, 1, 1, 2, 2] and ranks[1]["results"][sampling] == (None, [])   # the loops: leader only


def test_both_ranks_take_the_same_requests_at_the_same_steps(ranks):
    assert len(ranks[0]["log"]) > 20 and ranks[0]["log"] == ranks[1]["log"]


def test_the_synchronous_rollout_of_a_replica_runs_custom_loops_as_one_process(ranks, tmp_path):
    want = custom_rollout(1, str(tmp_path / "loops.yaml"))
    assert all(0 in m[:len(m) - m[::-1].index(1)] for m in want[1])     # two turns around the tool answer
    assert ranks[0]["rollout"] == want and ranks[1]["rollout"] is None
