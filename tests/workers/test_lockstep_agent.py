"""The multi-turn agent loop on a tensor-parallel replica (`lathe.workers.lockstep`: `Lockstep.run`, `ReplicaEngine`):
a leader and a follower over gloo (two processes) run trajectories of tool calls on a tiny random model, and the
leader's output is the one-process run's, token for token, tool call for tool call, turn for turn, greedy and seeded;
the tools sleep a random time and run on the leader only, a tool that raises or times out gives the same answers
and trajectories, and both ranks' engines take the same requests at the same steps. A leader whose loop fails stops
its follower at once, with its error. The synchronous loop's `Rollout` of a TP=2 replica (the `agent_demo` task)
returns one process's samples from its first rank."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port, gloo_rank, qwen_style_tokenizer, run_processes
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import replica_groups, shard_copy
from lathe.generation import SamplingParams
from lathe.rollout.agent.loop import AgentLoop, AgentSettings
from lathe.rollout.agent.parser import get_parser
from lathe.rollout.agent.tools import BaseTool, ToolResponse, ToolSet
from lathe.workers.lockstep import Lockstep, ReplicaEngine, control_groups
from rollout.agent.test_loop import tiny_model
from rollout.agent.test_render import TOOLS, rendered

JOIN_S = 60
R = "actor_rollout_ref.rollout"
TOOL_TIMEOUT_S = 1.0                # (a loaded machine may hold a 50 ms call's thread for a few hundred ms)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
QUESTIONS = ("What is 6*7?", "1+2=", "hi")
SAMPLINGS = {"greedy": dict(do_sample=False), "seeded": dict(temperature=1.0, seed=11)}
CASES = [("sleepy", "greedy"), ("failing", "seeded")]
CALLS: list[str] = []               # this process's tool calls


class Calculator(BaseTool):
    """Adds the digits of its expression after a random sleep (another on every rank and call). `failing`: an
    expression whose digits sum to 0 mod 3 raises, 1 mod 3 sleeps past the tool timeout."""

    def __init__(self, failing: bool):
        super().__init__(tool_schema=TOOLS[0])
        self.failing = failing

    async def execute(self, instance_id, parameters, **kwargs):
        expr = parameters["expression"]
        CALLS.append(expr)
        total = sum(int(c) for c in expr if c.isdigit())
        time.sleep(random.uniform(0.0, 0.05))
        if self.failing and total % 3 == 0:
            raise ValueError(f"no {expr}")
        if self.failing and total % 3 == 1:
            time.sleep(5.0)                              # (past the tool timeout)
        return ToolResponse(text=str(total)), 0.0, {}


def parse(text: str):
    """Every model turn calls the calculator on an expression made of its text (random tokens from the model)."""
    return get_parser("hermes")(CALL % f"{len(text)}+{sum(map(ord, text)) % 89}")


def engine_of(model, tok) -> LatheEngine:
    return LatheEngine(model, eos_token_id=tok.eos_token_id, block_size=4, num_kv_blocks=512, max_model_len=512)


def run_case(engine, tok, tools: str, sampling: str):
    """The case's agent-loop call on `engine` (a `LatheEngine` or a leader's `ReplicaEngine`): its output's record."""
    settings = AgentSettings(response_length=200, max_assistant_turns=3, tool_timeout_s=TOOL_TIMEOUT_S)
    loop = AgentLoop(engine, tok, settings, tools=ToolSet([Calculator(failing=tools == "failing")]), parse=parse)
    prompts = [rendered(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    out = loop.generate(prompts, SamplingParams(n=3, max_tokens=200, stop_token_ids=list(range(7, 107, 3)),
                                                **SAMPLINGS[sampling]), first_index=4)
    return {"tokens": out.token_ids, "masks": out.loss_masks, "turns": out.num_turns, "calls": out.tool_calls,
            "errors": out.tool_errors, "finish": out.finish_reasons, "logprobs": out.logprobs}


def recorded(engine) -> list:
    """Wrap `engine` so that it records (step, request id) of each request it takes and the sequences each step
    ran."""
    log, steps, add, step = [], [0], engine.add_request, engine.step

    def add_request(request_id, *args, **kwargs):
        log.append((steps[0], request_id))
        return add(request_id, *args, **kwargs)

    def counted():
        steps[0] += 1
        out = step()
        log.append(len(engine.scheduler.running))
        return out

    engine.add_request, engine.step = add_request, counted
    return log


def even_calls(text: str):
    """The `agent_demo` tool `f` called from every turn whose text has an even number of characters."""
    from lathe.rollout.agent.parser import ParsedTurn, ToolCall
    return ParsedTurn(text, [ToolCall("f", {})] if len(text) % 2 == 0 else [])


def agent_demo(patch=setattr):
    """The `agent_demo` task as these tests run it: its tool `f` called from every turn of even length (`even_calls`)
    after a random sleep (another on every rank and call). Returns the tokenizer, two prompts' rows (tokens, chat
    messages, each its secret for `f`) and the list of `f`'s calls in this process. `patch`: how the parser and the
    tool are replaced (pytest's monkeypatch.setattr in the test's process)."""
    from lathe.batch import Batch
    from lathe.models.hf import load_tokenizer
    from lathe.rollout.agent import builtin_tools, parser
    calls, execute = [], builtin_tools.SecretLookupTool.execute

    def sleepy(self, *args, **kwargs):
        calls.append(1)
        time.sleep(random.uniform(0.0, 0.05))
        return execute(self, *args, **kwargs)

    patch(parser, "get_parser", lambda fmt: even_calls)
    patch(builtin_tools.SecretLookupTool, "execute", sleepy)
    tok, items = load_tokenizer("builtin:tiny"), ("item 3", "item 5")
    prompts = Batch(non_tensors={"prompt_ids": [tok.encode(x) for x in items],
                                 "raw_prompt": [[{"role": "user", "content": x}] for x in items],
                                 "extra_info": [{"tools_kwargs": {"f": {"create_kwargs": {"secret": x[-1]}}}}
                                                for x in items]})
    return tok, prompts, calls


def started_rollout(cfg, tok):
    """The synchronous loop's `Rollout` (`lathe.workers.rollout`) of `cfg` beside a stand-in of a sharded actor (the
    built-in tiny policy), started with the run's agent loop."""
    from types import SimpleNamespace

    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, select_impl
    from lathe.rollout.agent import build_agent_loop
    from lathe.workers.rollout import Rollout
    path, kwargs = _given_model(cfg, tok)
    loaded = load_policy(path, **kwargs)
    actor = SimpleNamespace(device=torch.device("cpu"), model=select_impl(loaded, "auto", role="rollout"),
                            sharded=True, lora=False, arr=cfg.actor_rollout_ref)
    rollout = Rollout(cfg.actor_rollout_ref.rollout, actor, loaded, tok)
    rollout.start(lambda engine: build_agent_loop(cfg, engine, tok))
    return rollout


def sync_rollout(tp: int, patch=setattr):
    """The synchronous loop's `Rollout` (`lathe.workers.rollout`) of `agent_demo` on a tensor-parallel replica of
    `tp` ranks, beside a stand-in of a sharded actor (the built-in tiny policy): its samples' responses, tool calls
    and turns (None on a follower), and this process's tool calls."""
    from lathe.config import load_config
    tok, prompts, calls = agent_demo(patch)
    cfg = load_config("agent_demo", [f"trainer.n_gpus_per_node={tp}", f"{R}.tensor_model_parallel_size={tp}",
                                     f"{R}.multi_turn.max_assistant_turns=3", "data.max_response_length=64"])
    rollout = started_rollout(cfg, tok)
    batch = rollout.generate_sequences(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=64, seed=5))
    if batch is None:
        return None, len(calls)
    rows = [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]
    return (rows, list(batch["tool_calls"]), list(batch["num_turns"])), len(calls)


def tp_replica(tok):
    """This rank's replica of two ranks of the tiny model (its engine's requests and steps `recorded`), the random
    module seeded apart on each rank: (the replica, its engine, the record)."""
    tp = replica_groups(2)
    control = control_groups(2, JOIN_S)
    engine = engine_of(shard_copy(tiny_model(tok), torch.float32, torch.device("cpu"), tp), tok)
    log = recorded(engine)
    random.seed(os.getpid())                 # the tools' sleeps differ between the ranks (and would, between runs)
    return Lockstep(engine, tp, control, timeout_s=JOIN_S), engine, log


def rank_body(rank: int):
    tok = qwen_style_tokenizer()
    replica, engine, log = tp_replica(tok)
    results = {}
    for case in CASES:
        CALLS.clear()
        out = replica.run(lambda: run_case(ReplicaEngine(replica), tok, *case))
        results[case] = (out, list(CALLS))
    start = time.monotonic()
    failed = None
    try:
        replica.run(lambda: 1 / 0)
    except (ZeroDivisionError, RuntimeError) as e:
        failed = (type(e).__name__, str(e), time.monotonic() - start)
    interval = engine.scheduler.prefill_interval     # (restored: the leader's loop and the follower's run)
    plain = engine.generate([[5, 6, 7]], SamplingParams(n=2, temperature=0, max_tokens=6)).token_ids
    return {"results": results, "log": log, "failed": failed, "after": (interval, plain), "rollout": sync_rollout(2)}


def rank_main(rank: int, port: int, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: rank_body(rank), JOIN_S)


@pytest.fixture(scope="module")
def ranks() -> dict:
    """Both ranks' records (forkserver processes: one server imports torch and lathe once)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, queue), daemon=True) for r in range(2)]
    return run_processes(procs, queue, 3 * JOIN_S)


@pytest.mark.parametrize("tools,sampling", CASES)
def test_the_replica_runs_the_trajectories_one_process_runs(ranks, tools, sampling):
    tok = qwen_style_tokenizer()
    CALLS.clear()
    want = run_case(engine_of(tiny_model(tok), tok), tok, tools, sampling)
    got, calls = ranks[0]["results"][(tools, sampling)]
    assert sum(want["calls"]) >= 9 and max(want["turns"]) > 3            # several tool turns per trajectory
    if tools == "failing":
        assert 0 < sum(want["errors"]) < sum(want["calls"])              # raised or timed out, and answered
    for key in ("tokens", "masks", "turns", "calls", "errors", "finish"):
        assert got[key] == want[key], key
    a, b = torch.tensor(sum(got["logprobs"], [])), torch.tensor(sum(want["logprobs"], []))
    assert (a - b).norm() <= 1e-4 * b.norm()
    assert len(calls) == sum(want["calls"]) and sorted(calls) == sorted(CALLS)     # each call once, on the leader
    assert ranks[1]["results"][(tools, sampling)] == (None, [])                      # the follower ran no tool


def test_both_ranks_take_the_same_requests_at_the_same_steps(ranks):
    assert len(ranks[0]["log"]) > 30 and ranks[0]["log"] == ranks[1]["log"]
    assert ranks[0]["after"][0] == ranks[1]["after"][0] == 1 and ranks[0]["after"] == ranks[1]["after"]


def test_a_failing_leader_stops_its_follower_with_its_error(ranks):
    assert ranks[0]["failed"][:2] == ("ZeroDivisionError", "division by zero")
    kind, message, seconds = ranks[1]["failed"]
    assert kind == "RuntimeError" and "its leader, rank 0, failed: ZeroDivisionError" in message
    assert seconds < JOIN_S / 2                                    # at once, not at the timeout


def test_the_synchronous_rollout_of_a_replica_returns_one_process_samples(ranks, monkeypatch):
    want, calls = sync_rollout(1, monkeypatch.setattr)
    assert sum(want[1]) > 0 and calls == sum(want[1]) and max(want[2]) > 3          # several tool turns
    assert ranks[0]["rollout"] == (want, calls) and ranks[1]["rollout"] == (None, 0)
