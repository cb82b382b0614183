"""Fully-async rollout replicas on data-parallel attention (`lathe.workers.fully_async.RolloutWorker`,
`_loop_in_lockstep`): an engine of two replicas, of one gloo rank each or of two tensor-parallel ranks, whose tiny
Qwen3-MoE experts are spread over all its ranks. Each replica is driven as the driver drives it: requests streamed to
one replica while the other, with none, steps in its collectives; a pause of both (each parks only once both hold); new
whole weights received by every rank, each keeping its slices and its experts; requests to both after. Each replica's
samples are one unsharded engine's for its requests, with the old weights before the sync and the new ones after."""

from __future__ import annotations

import threading
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
# each replica's requests after the sync: (request id, prompts, first sample index)
AFTER = (("b", PROMPTS[2:], 4), ("c", PROMPTS[1:2], 8))


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
        result = {k: (responses(b), b["rollout_versions"].unique().tolist()) for k, b in got.items()}
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
    assert results[0] == {"a": (want["a"], [0]), "b": (want["b"], [1])}
    assert results[tp] == {"c": (want["c"], [1])}
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
    else:
        _collect_until(worker, set(), timeout_s=1)
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
