"""Fully-async rollout replicas on data-parallel attention (`lathe.workers.fully_async.RolloutWorker`,
`_loop_in_lockstep`): an engine of two replicas, of one gloo rank each or of two tensor-parallel ranks, whose tiny
Qwen3-MoE experts are spread over all its ranks. Each replica is driven as the driver drives it: requests streamed to
one replica while the other, with none, steps in its collectives; a pause of both (each parks only once both hold); new
whole weights received by every rank, each keeping its slices and its experts; requests to both after, then requests
paused while running (interrupted and continued) and with partial=False (finished before the replicas park). Each
replica's samples are one unsharded engine's for its requests, with the old weights before the sync and the new ones
after. A replica's multi-turn trajectories in the lockstep are one worker's."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from engine.conftest import PROMPTS
from engine.test_tensor_parallel import new_weights
from helpers import free_port, gloo_rank, run_processes
from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from lathe.workers.checkpoint_engine import SyncGroup, metas_of, send_weights

JOIN_S = 120
R = "actor_rollout_ref.rollout"
LONG = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
# each replica's requests after the sync: (request id, prompts, first sample index); then, on the same weights, one
# each paused while running (interrupted, continued) and one each paused with partial=False (finished first)
AFTER = (("b", PROMPTS[2:], 4), ("c", PROMPTS[1:2], 8))
CUT = (("d", PROMPTS[:1], 12), ("e", PROMPTS[3:], 14))
WAITED = (("f", PROMPTS[1:3], 16), ("g", PROMPTS[:1], 20))


def responses(batch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]


def replica_rank(rank: int, tp: int, sync_port: int, path: str):
    """One rank of the rollout pool; a replica's leader drives it as the driver would (the leaders at once, each in
    its own process): replica 0 alone generates before the sync, both after. The leaders' results."""
    from lathe.config import load_config
    from lathe.workers.fully_async import RolloutWorker
    from workers.test_fully_async import _collect_until
    cfg = load_config("default", [f"rollout.n_gpus_per_node={2 * tp}", "actor_rollout_ref.hybrid_engine=false",
                                  "data.train_batch_size=0", f"{R}.tensor_model_parallel_size={tp}",
                                  f"{R}.data_parallel_size=2", f"{R}.expert_parallel_size={2 * tp}",
                                  f"{R}.data_parallel_attention=always", "data.max_response_length=24"])
    worker = RolloutWorker(cfg, path, {"impl": "auto"}, SimpleNamespace(pad_token_id=0, eos_token_id=2),
                           device_type="cpu")
    assert worker.dp is not None and worker.engine.dp is not None
    worker.join_sync_group("127.0.0.1", sync_port, 1 + rank, 1 + 2 * tp, JOIN_S)     # whole tensors to every rank
    replica, result = rank // tp, None
    if worker.replica.leader:
        got = {}
        if replica == 0:
            worker.submit([("a", PROMPTS[:2], LONG, 0)])
            got.update(_collect_until(worker, {"a"}))
        assert worker.pause(partial=True, timeout_s=JOIN_S) == 0
        metas = metas_of(load_lathe_model(path, torch.float32).state_dict().items(), torch.float32)
        worker.receive_weights(metas, 1 << 14, 1)
        worker.resume()
        request_id, prompts, first = AFTER[replica]
        worker.submit([(request_id, prompts, LONG, first)])
        got.update(_collect_until(worker, {request_id}))
        request_id, prompts, first = CUT[replica]               # paused mid-way (when the timing allows)
        worker.submit([(request_id, prompts, LONG, first)])
        time.sleep(0.05)                                        # (its prefill and a few steps)
        interrupted = worker.pause(partial=True, timeout_s=JOIN_S)
        worker.resume()
        got.update(_collect_until(worker, {request_id}))
        request_id, prompts, first = WAITED[replica]            # partial=False: the pause waits for them
        worker.submit([(request_id, prompts, LONG, first)])
        assert worker.pause(partial=False, timeout_s=JOIN_S) == 0
        done = worker.collect()["done"]
        worker.resume()
        assert [k for k, _ in done] == [request_id]             # finished before the replica parked
        got.update(done)
        result = ({k: (responses(b), b["rollout_versions"].unique().tolist()) for k, b in got.items()}, interrupted)
    worker.shutdown()
    assert not worker._thread.is_alive()
    return result


def rank_main(rank: int, tp: int, port: int, sync_port: int, path: str, queue) -> None:
    def work():
        sender = None
        if rank == 0:                   # the trainer's rank 0: the new weights, whole, to every rollout rank
            sender = threading.Thread(target=send, args=(sync_port, path, 1 + 2 * tp))
            sender.start()
        result = replica_rank(rank, tp, sync_port, path)
        if sender is not None:
            sender.join(timeout=JOIN_S)
        return result
    gloo_rank(rank, 2 * tp, port, queue, work, JOIN_S)


def send(port: int, path: str, world: int) -> None:
    group = SyncGroup("127.0.0.1", port, 0, world, device=torch.device("cpu"), timeout_s=JOIN_S)
    named = list(new_weights(path))
    send_weights(group, named, metas_of(named, torch.float32), bucket_bytes=1 << 14)
    group.close()


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_replicas_of_data_parallel_attention_stream_what_one_engine_streams(tmp_path, tp):
    from models.lathe_tiny import MOE, save_hf
    path = str(save_hf(tmp_path, MOE)[0])
    engine = LatheEngine(load_lathe_model(path, torch.float32), eos_token_id=None, block_size=4, num_kv_blocks=64,
                         max_model_len=48)
    want = {"a": engine.generate(PROMPTS[:2], LONG).token_ids}
    engine.update_weights(new_weights(path))
    want.update({k: engine.generate(prompts, LONG, first_index=first).token_ids for k, prompts, first in AFTER})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port, sync_port = ctx.Queue(), free_port(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, tp, port, sync_port, path, queue), daemon=True)
             for r in range(2 * tp)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    want.update({k: engine.generate(prompts, LONG, first_index=first).token_ids for k, prompts, first in WAITED})
    (got0, _), (got1, _) = results[0], results[tp]      # (how many were interrupted: timing; 2 and 2 here)
    assert {k: got0[k] for k in "abf"} == {"a": (want["a"], [0]), "b": (want["b"], [1]), "f": (want["f"], [1])}
    assert {k: got1[k] for k in "cg"} == {"c": (want["c"], [1]), "g": (want["g"], [1])}
    # an interrupted response continues on the same weights: its recomputed KV may move later tokens by the last bits
    assert [len(t) for t in got0["d"][0]] == [24, 24] and [len(t) for t in got1["e"][0]] == [24, 24]
    assert got0["d"][1] == got1["e"][1] == [1]
    assert all(results[r] is True for r in range(2 * tp) if r % tp)        # followers: nothing of their own


# -- multi-turn trajectories in the replicas' lockstep -----------------------------------------------------------------

DP_KEYS = ["rollout.n_gpus_per_node=2", f"{R}.data_parallel_size=2", f"{R}.expert_parallel_size=2",
           f"{R}.data_parallel_attention=always"]


def agent_rank(rank: int, path: str):
    """Replica `rank` of 2: replica 0 runs the `agent_demo` request's trajectories, replica 1 has none and steps in
    its collectives (its agent stream idle). Replica 0's record and each replica's count of tool calls."""
    from loop.test_async_tp import agent_record, agent_worker
    from workers.test_fully_async import _collect_until
    worker, request, calls = agent_worker(DP_KEYS, path)
    assert worker.dp is not None
    record = None
    if rank == 0:
        worker.submit([request])
        record = agent_record(_collect_until(worker, {"r"})["r"])
    torch.distributed.barrier()         # (replica 1 serves replica 0's steps until this: then both shut down)
    worker.shutdown()
    return record, len(calls)


def agent_rank_main(rank: int, port: int, path: str, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: agent_rank(rank, path), JOIN_S)


def test_multi_turn_trajectories_in_the_replicas_lockstep_are_one_workers(tmp_path, monkeypatch):
    """The agent stream of a replica of data-parallel attention queues its turns, agrees with the other replica each
    tick and steps (the other stepping idle in its collectives): the trajectories, tool calls and turns of one
    unsharded worker's, the tools run once."""
    from lathe.models.hf import load_tokenizer
    from loop.test_async_tp import agent_record, agent_worker
    from rollout.agent.test_agent_data_parallel import moe_checkpoint
    from workers.test_fully_async import _collect_until
    path = moe_checkpoint(tmp_path, len(load_tokenizer("builtin:tiny")), 7)
    worker, request, calls = agent_worker(["rollout.n_gpus_per_node=1"], path, monkeypatch.setattr)
    worker.submit([request])
    want = agent_record(_collect_until(worker, {"r"})["r"])
    worker.shutdown()
    assert 0 < sum(want[1]) == len(calls)                                     # the tools were called
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=agent_rank_main, args=(r, port, path, queue), daemon=True) for r in range(2)]
    got = run_processes(procs, queue, 3 * JOIN_S)
    assert got[0] == (want, sum(want[1])) and got[1] == (None, 0)


class _OneReplica:
    """A stand-in engine of one replica (its agreements are its own flags): the lockstep loop in one process."""

    size, rank = 2, 0

    def agree(self, values):
        return list(values)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "plain"])
def test_a_pause_after_trajectories_end_between_steps_does_not_wait_for_them(tmp_path, monkeypatch, lockstep):
    """A trajectory can end in the agent stream's `advance`, with no engine step after it (here its user stops after
    every tool answer): the replica is then finished, and pause(partial=False) parks it at once (review of 51c3483:
    the lockstep loop kept it unfinished, and the pause waited out its timeout)."""
    import workers.test_lockstep_agent as demo
    from lathe.config import load_config
    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, load_tokenizer
    from lathe.rollout.agent.loop import AgentLoop
    from lathe.rollout.agent.parser import ParsedTurn, ToolCall
    from lathe.workers.fully_async import RolloutWorker
    from loop.test_async_tp import agent_worker
    from workers.test_fully_async import _collect_until
    monkeypatch.setattr(demo, "even_calls", lambda text: ParsedTurn(text, [ToolCall("f", {})]))   # every turn calls
    monkeypatch.setattr(AgentLoop, "_on_answers", lambda self, t: self._finish(t, "stop"))      # the user stops
    if lockstep:
        def loop(self):
            self.dp = _OneReplica()
            self._loop_in_lockstep()
        monkeypatch.setattr(RolloutWorker, "_loop", loop)
    cfg = load_config("agent_demo", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                     "data.train_batch_size=0"])
    path, kwargs = _given_model(cfg, load_tokenizer("builtin:tiny"))
    load_policy(path, **kwargs).save_pretrained(tmp_path / "model")
    worker, request, _ = agent_worker(["rollout.n_gpus_per_node=1"], str(tmp_path / "model"), monkeypatch.setattr)
    try:
        worker.submit([request])
        assert sum(_collect_until(worker, {"r"})["r"]["tool_calls"]) > 0
        assert worker.pause(partial=False, timeout_s=3) == 0
        worker.resume()
    finally:
        worker.shutdown()


class _Agreements(_OneReplica):
    """`_OneReplica` that keeps every agreement's flags."""

    def __init__(self):
        self.seen: list[list[int]] = []

    def agree(self, values):
        self.seen.append(list(values))
        return list(values)


def test_a_request_the_engine_refuses_fails_the_replica_at_the_agreement_before_any_step(tmp_path, monkeypatch):
    """Data-parallel attention: each engine step is a collective of every replica, so a request a replica's engine
    refuses (a prompt past max_model_len) must fail it before the tick's step, in the agreement that tells the other
    replicas (which then raise too instead of waiting in the step's collectives for nccl_timeout). Before, the refusal
    raised inside `Lockstep.step`, after the agreement had sent every replica into the step."""
    from lathe.config import load_config
    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, load_tokenizer
    from lathe.workers.fully_async import RolloutWorker
    from workers.test_fully_async import _collect_until
    agreements, steps = _Agreements(), []

    def loop(self):
        self.dp = agreements
        self._loop_in_lockstep()
    monkeypatch.setattr(RolloutWorker, "_loop", loop)
    monkeypatch.setattr(LatheEngine, "step", lambda self, step=LatheEngine.step: steps.append(1) or step(self))
    cfg = load_config("default", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                  "data.train_batch_size=0"])
    tokenizer = load_tokenizer("builtin:tiny")
    path, kwargs = _given_model(cfg, tokenizer)
    load_policy(path, **kwargs).save_pretrained(tmp_path / "model")
    worker = RolloutWorker(cfg, str(tmp_path / "model"), {"impl": "auto"}, tokenizer, device_type="cpu")
    try:
        worker.submit([("fits", [[3, 4]], SamplingParams(max_tokens=2, ignore_eos=True), 0)])
        assert len(_collect_until(worker, {"fits"})) == 1 and steps          # the lockstep loop runs
        ran = len(steps)
        too_long = [[3] * worker.engine.max_model_len]
        worker.submit([("too long", too_long, SamplingParams(max_tokens=2), 0)])
        with pytest.raises(RuntimeError, match="engine failed.*add_request 'too long'.*max_model_len"):
            _collect_until(worker, {"too long"}, timeout_s=10)
        assert agreements.seen[-1][3] == 1 and len(steps) == ran             # told as failed; no step taken
    finally:
        worker.shutdown()
