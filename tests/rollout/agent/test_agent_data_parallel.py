"""The multi-turn agent loop on an engine of data-parallel attention (`lathe.engine.data_parallel`): two replicas of
one gloo rank each, a tiny random Qwen3-MoE's experts split between them, each running the loop on its share of the
prompts in the replicas' lockstep (`AgentLoop._run`: one agreement a tick, an idle replica stepping in the others'
collectives, a replica with tools running waiting for them a tick at a time) and a replica with no prompts serving
the others (`serve_replicas`). Each replica's trajectories are one process's for its share, token for token, turn
for turn, greedy and seeded; the tools sleep a random time, so the replicas' steps interleave differently each
run. Then the same through the rollout worker (`lathe.workers.rollout.Rollout`), as `lathe train` drives it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port, gloo_rank, qwen_style_tokenizer, run_processes
from lathe.engine.data_parallel import engine_groups
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from lathe.rollout.agent.loop import AgentLoop, AgentSettings
from lathe.rollout.agent.tools import ToolSet
from models.lathe_tiny import hf_config
from rollout.agent.test_render import rendered
from workers.test_lockstep_agent import QUESTIONS, SAMPLINGS, Calculator, parse

JOIN_S = 60
N = 2
R = "actor_rollout_ref.rollout"
ROLLOUT_SHARES = ([[0], [1]], [[0, 1], []])     # (the worker test) each replica a prompt; then replica 1 none
# each call: the prompts each replica runs (replica 0's share first); the last leaves replica 1 without any
SHARES = (((0, 2), (2, 3)), ((0, 3), (3, 3)))


def engine_of(model, tok) -> LatheEngine:
    return LatheEngine(model, eos_token_id=tok.eos_token_id, block_size=4, num_kv_blocks=512, max_model_len=512)


def loop_of(engine, tok) -> AgentLoop:
    settings = AgentSettings(response_length=120, max_assistant_turns=3, tool_timeout_s=5.0)
    return AgentLoop(engine, tok, settings, tools=ToolSet([Calculator(failing=False)]), parse=parse)


def record(out) -> dict:
    return {"tokens": out.token_ids, "masks": out.loss_masks, "turns": out.num_turns, "calls": out.tool_calls}


def params_of(tok, sampling: str) -> SamplingParams:
    return SamplingParams(n=N, max_tokens=120, stop_token_ids=list(range(7, 107, 3)), **SAMPLINGS[sampling])


def prompts_of(tok) -> list[list[int]]:
    return [rendered(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]


def replica_calls(rank: int, path: str) -> list:
    """Replica `rank` of 2 (gloo, one rank each): the agent loop's calls on its shares (None where it served)."""
    tp, dp = engine_groups(1, 2)
    model = shard_copy(load_lathe_model(path, torch.float32), torch.float32, torch.device("cpu"), tp,
                       expert_parallel_size=2, dp=dp)
    tok = qwen_style_tokenizer()
    loop, prompts, out = loop_of(engine_of(model, tok), tok), prompts_of(tok), []
    for sampling in SAMPLINGS:
        for shares in SHARES:
            start, end = shares[rank]
            if start == end:
                loop.serve_replicas()
                out.append(None)
            else:
                out.append(record(loop.generate(prompts[start:end], params_of(tok, sampling),
                                                first_index=start * N)))
    return out


def worker(rank: int, port: int, path: str, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: replica_calls(rank, path), JOIN_S)


def failing_call(rank: int, path: str) -> tuple[str, str, float]:
    """Replica `rank` of 2 runs the loop on one prompt; replica 1's parser raises at its first turn: (this replica's
    error type, its message, seconds until it came)."""
    import time
    tp, dp = engine_groups(1, 2)
    model = shard_copy(load_lathe_model(path, torch.float32), torch.float32, torch.device("cpu"), tp,
                       expert_parallel_size=2, dp=dp)
    tok = qwen_style_tokenizer()
    loop = loop_of(engine_of(model, tok), tok)
    if rank == 1:
        def broken(text):
            raise ValueError("a broken parser")
        loop.parse = broken
    start = time.monotonic()
    try:
        loop.generate(prompts_of(tok)[rank:rank + 1], params_of(tok, "greedy"), first_index=rank * N)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "none", "", time.monotonic() - start


def moe_checkpoint(where, vocab_size: int, seed: int) -> str:
    """tests/models' tiny Qwen3-MoE (4 experts, 2 a token) over a tokenizer's vocabulary, saved in `where`."""
    from transformers import AutoModelForCausalLM
    config = hf_config("qwen3_moe")
    config.vocab_size, config.max_position_embeddings = vocab_size, 512
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(where / "qwen3_moe")
    return str(where / "qwen3_moe")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory.mktemp("dp-agent"), len(qwen_style_tokenizer()), 0)


def test_the_agent_loop_on_replicas_of_data_parallel_attention_runs_what_one_process_runs(moe_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, moe_path, queue), daemon=True) for r in range(2)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    tok = qwen_style_tokenizer()
    loop = loop_of(engine_of(load_lathe_model(moe_path, torch.float32), tok), tok)
    want = [record(loop.generate(prompts_of(tok), params_of(tok, sampling))) for sampling in SAMPLINGS]
    assert max(t for w in want for t in w["calls"]) > 0                        # the tools were called
    for rank, got in results.items():
        assert not isinstance(got, str), got
        for i, (sampling, shares) in enumerate((s, sh) for s in SAMPLINGS for sh in SHARES):
            start, end = shares[rank]
            if start == end:
                assert got[i] is None
                continue
            whole = want[list(SAMPLINGS).index(sampling)]
            assert got[i] == {k: v[start * N:end * N] for k, v in whole.items()}, (rank, sampling, shares)


def dp_rollout(path: str, dp: int, shares: list[list[int]], patch=setattr, tp: int = 1) -> tuple:
    """The synchronous loop's `Rollout` (`lathe.workers.rollout`) of the `agent_demo` task on `path`'s MoE model:
    with `dp` > 1 this rank belongs to replica `dist.get_rank() // tp` (of `tp` ranks) of an engine of data-parallel
    attention, beside a stand-in of a sharded actor, and generates the prompts `shares[replica]` (none: it serves
    the others); else one process. Returns, per call, each sample's response, tool calls and turns (None where it
    served, and on a replica's followers), and the tool's calls."""
    from types import SimpleNamespace

    from lathe.config import load_config
    from lathe.models.hf import load_policy, select_impl
    from lathe.rollout.agent import build_agent_loop
    from lathe.workers.rollout import Rollout
    from workers.test_lockstep_agent import agent_demo
    tok, prompts, calls = agent_demo(patch)
    keys = [f"{R}.data_parallel_size={dp}", f"{R}.expert_parallel_size={dp * tp}", f"{R}.data_parallel_attention=always",
            f"{R}.tensor_model_parallel_size={tp}"]
    cfg = load_config("agent_demo", [f"trainer.n_gpus_per_node={dp * tp}", f"{R}.multi_turn.max_assistant_turns=3",
                                     "data.max_response_length=64", *(keys if dp > 1 else [])], device_count=dp * tp)
    loaded = load_policy(path)
    actor = SimpleNamespace(device=torch.device("cpu"), model=select_impl(loaded, "auto", role="rollout"),
                            sharded=dp > 1, lora=False, arr=cfg.actor_rollout_ref)
    rollout = Rollout(cfg.actor_rollout_ref.rollout, actor, loaded, tok)
    rollout.start(lambda engine: build_agent_loop(cfg, engine, tok))
    rank, out = (dist.get_rank() if dp > 1 else 0), []
    for share in shares:
        mine = share[rank // tp] if dp > 1 else list(range(len(prompts["prompt_ids"])))
        params = SamplingParams(n=N, temperature=1.0, max_tokens=64, seed=5)
        batch = rollout.generate_sequences(prompts.select(mine), params, first_index=(mine[0] if mine else 0) * N)
        out.append(None if batch is None else (
            [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])],
            list(batch["tool_calls"]), list(batch["num_turns"])))
    return out, len(calls)



def failing_worker(rank: int, port: int, path: str, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: failing_call(rank, path), JOIN_S)


def test_a_replica_whose_loop_fails_stops_the_others_at_once(moe_path):
    """An error in one replica's loop (here its parser's) is told to the others at the next agreement: it raises its
    own error, they raise naming it, none waits for a collective's timeout."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=failing_worker, args=(r, port, moe_path, queue), daemon=True) for r in range(2)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    assert results[1][:2] == ("ValueError", "a broken parser"), results[1]
    assert results[0][0] == "RuntimeError" and "another replica" in results[0][1], results[0]
    assert max(r[2] for r in results.values()) < 0.5 * JOIN_S


def rollout_worker(rank: int, port: int, path: str, queue, tp: int) -> None:
    gloo_rank(rank, 2 * tp, port, queue, lambda: dp_rollout(path, 2, ROLLOUT_SHARES, tp=tp), JOIN_S)


@pytest.fixture(scope="module")
def demo_moe_path(tmp_path_factory):
    """Over the `agent_demo` task's tokenizer (built-in, tiny); a seed whose turns call the tool on both prompts."""
    from lathe.models.hf import load_tokenizer
    return moe_checkpoint(tmp_path_factory.mktemp("dp-agent-demo"), len(load_tokenizer("builtin:tiny")), 7)


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_the_rollout_worker_runs_the_agent_loop_on_data_parallel_attention(demo_moe_path, monkeypatch, tp):
    """`lathe.workers.rollout.Rollout` with verl's data-parallel-attention layout and the agent loop, on two replicas
    of one rank, or of two tensor-parallel ranks (the experts over all four; each replica's leader runs its loop and
    the leaders agree each tick, their followers following: `lathe.workers.lockstep`): each replica's samples, tool
    calls and turns are one process's for its prompts, and a replica called with none serves the other's steps and
    returns None (as a follower always does)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rollout_worker, args=(r, port, demo_moe_path, queue, tp), daemon=True)
             for r in range(2 * tp)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    (whole, *_), calls = dp_rollout(demo_moe_path, 1, [None], monkeypatch.setattr)
    assert all(any(whole[1][i * N:(i + 1) * N]) for i in range(2))           # each prompt's turns called the tool
    for rank, got in results.items():
        assert not isinstance(got, str), got
        for (share, out) in zip(ROLLOUT_SHARES, got[0]):
            mine = share[rank // tp]
            if not mine or rank % tp:
                assert out is None
                continue
            assert out == tuple(col[mine[0] * N:(mine[-1] + 1) * N] for col in whole), (rank, share)
