"""A tensor-parallel rollout replica of fully-async training in lockstep (`lathe.workers.lockstep`): a leader and a
follower over gloo (two processes) stream requests, are interrupted at a weight sync (partial rollout), receive the
new whole weights from a sender over the checkpoint engine's `SyncGroup` (each keeping its slices), and resume; the
tokens, log-prob count and weight versions equal those of one unsharded engine fed the same requests in the same
steps. A follower that hears nothing from its leader names it."""

from __future__ import annotations

import datetime
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.conftest import PROMPTS
from engine.test_tensor_parallel import new_weights
from helpers import free_port, run_processes
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import replica_groups, shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from lathe.workers.checkpoint_engine import SyncGroup, metas_of, receive_weights, send_weights
from lathe.workers.lockstep import Lockstep, control_groups

JOIN_S = 120
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=12, seed=3)
GREEDY = SamplingParams(n=1, temperature=0, max_tokens=12)
# (steps before the action, action): requests added at a step, then the sync, then more requests
SCRIPT = [(0, ("add", [("a", PROMPTS[:2], SAMPLED, 0), ("b", PROMPTS[2:3], GREEDY, 0)])),
          (3, ("add", [("c", PROMPTS[3:], SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5), 4)])),
          (2, ("sync", 1)),
          (0, ("add", [("d", PROMPTS[1:3], SAMPLED, 0)]))]


def engine_of(model) -> LatheEngine:
    return LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48)


def play(step, sync) -> dict:
    """Run SCRIPT: `step(new requests)` returns finished (id, output) pairs; `sync(version)` interrupts and loads
    the new weights. Returns {request id: (tokens, number of log-probs, versions)}."""
    done, new = {}, []

    def take(outputs):
        done.update({rid: (out.token_ids, [len(x) for x in out.logprobs], out.versions) for rid, out in outputs})

    for steps, (kind, arg) in SCRIPT:
        for _ in range(steps):
            take(step(new))
            new = []
        if kind == "add":
            new += [(rid, prompts, params, first, None) for rid, prompts, params, first in arg]
        else:
            sync(arg)
    while len(done) < 4:
        take(step(new))
        new = []
    return done


def reference(path: str) -> dict:
    engine = engine_of(load_lathe_model(path, torch.float32))
    replica = Lockstep(engine, replica_groups(1), None, timeout_s=JOIN_S)       # (one rank: the engine alone)

    def sync(version):
        assert replica.interrupt() > 0                    # in-flight samples: the partial rollout is exercised
        engine.load_weights(new_weights(path), version=version)

    return play(replica.step, sync)


def worker(rank: int, port: int, sync_port: int, path: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=JOIN_S))
        tp = replica_groups(2)
        control = control_groups(2, JOIN_S)
        quick = control_groups(2, 1.0)                   # (for the silent leader at the end)
        engine = engine_of(shard_copy(load_lathe_model(path, torch.float32), torch.float32, torch.device("cpu"), tp))
        replica = Lockstep(engine, tp, control, timeout_s=JOIN_S)
        cpu = torch.device("cpu")
        sender = threading.Thread(target=send, args=(sync_port, path)) if rank == 0 else None
        if sender is not None:
            sender.start()                               # the trainer's rank 0, sending over the SyncGroup
        group = SyncGroup("127.0.0.1", sync_port, 1 + rank, 3, device=cpu, timeout_s=JOIN_S)

        def receive(args):
            return receive_weights(group, args["metas"], bucket_bytes=args["bucket_bytes"],
                                   consume=lambda named: engine.load_weights(named, version=args["version"]))

        metas = metas_of(load_lathe_model(path, torch.float32).state_dict().items(), torch.float32)
        if rank == 0:
            def sync(version):
                assert replica.interrupt() > 0
                replica.load({"metas": metas, "bucket_bytes": 1 << 14, "version": version}, receive)

            result = play(replica.step, sync)
            replica.stop()
            sender.join(timeout=JOIN_S)
            time.sleep(2.0)                              # silent: the follower's quick group times out
        else:
            replica.follow(receive)
            result = None
            with pytest.raises(TimeoutError, match="rank 1 .* no message from its leader, rank 0"):
                Lockstep(engine, tp, quick, timeout_s=1.0).follow(receive)
        group.close()
        queue.put((rank, result))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def send(port: int, path: str) -> None:
    group = SyncGroup("127.0.0.1", port, 0, 3, device=torch.device("cpu"), timeout_s=JOIN_S)
    named = list(new_weights(path))
    send_weights(group, named, metas_of(named, torch.float32), bucket_bytes=1 << 14)
    group.close()


def test_a_tensor_parallel_replica_streams_what_one_engine_streams(tmp_path):
    from models.lathe_tiny import save_hf
    path = str(save_hf(tmp_path, "llama", tie=True)[0])      # tied: the LM head's slices come from the embeddings
    want = reference(path)
    assert any(len({v for v, _ in spans}) > 1 for _, _, versions in want.values() for spans in versions)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    port, sync_port = free_port(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, sync_port, path, queue), daemon=True) for r in range(2)]
    got = run_processes(procs, queue, 3 * JOIN_S)[0]
    assert got == want
