"""A tensor-parallel rollout replica of fully-async training in lockstep (`lathe.workers.lockstep`): a leader and a
follower over gloo (two processes) stream requests, are interrupted at a weight sync (partial rollout), receive the
new whole weights from a sender over the checkpoint engine's `SyncGroup` (each keeping its slices), and resume; the
tokens, log-prob count and weight versions equal those of one unsharded engine fed the same requests in the same
steps. A follower that hears nothing from its leader names it. The rollout worker's ranks take the resharding sync
(each receives only its slices, over the group of its tensor-parallel position), and run multi-turn trajectories
with the tools on its leader alone, as one worker runs them."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.conftest import PROMPTS
from engine.test_tensor_parallel import new_weights
from helpers import free_port, gloo_rank, run_processes
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import replica_groups, shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from lathe.models.vl import load_lathe_vl_model
from lathe.workers.checkpoint_engine import SyncGroup, metas_of, receive_weights, send_weights
from lathe.workers.lockstep import Lockstep, control_groups
from lathe.workers.reshard import position_layouts, send_resharded, sliced_metas

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


def is_vl(path: str) -> bool:
    with open(os.path.join(path, "config.json")) as f:
        return "vision_config" in json.load(f)


def load(path: str):
    """lathe's model of `path` in float32: its VL model for a vision-language checkpoint, else its decoder."""
    return load_lathe_vl_model(path) if is_vl(path) else load_lathe_model(path, torch.float32)


def script_of(path: str) -> list:
    """SCRIPT, or for a VL checkpoint the same actions on image prompts (two with images, two without), each request
    carrying its prompts' images."""
    if not is_vl(path):
        return SCRIPT
    from engine.test_multimodal import _prompts
    prompts, images = _prompts()
    return [(0, ("add", [("a", prompts[1:3], SAMPLED, 0, images[1:3]), ("b", prompts[:1], GREEDY, 0, images[:1])])),
            (3, ("add", [("c", prompts[2:], SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5), 4,
                          images[2:])])),
            (2, ("sync", 1)),
            (0, ("add", [("d", prompts[1:2] + prompts[3:], SAMPLED, 0, images[1:2] + images[3:])]))]


def play(step, sync, script=SCRIPT) -> dict:
    """Run `script`: `step(new requests)` returns finished (id, output) pairs; `sync(version)` interrupts and loads
    the new weights. Returns {request id: (tokens, number of log-probs, versions)}."""
    done, new = {}, []

    def take(outputs):
        done.update({rid: (out.token_ids, [len(x) for x in out.logprobs], out.versions) for rid, out in outputs})

    for steps, (kind, arg) in script:
        for _ in range(steps):
            take(step(new))
            new = []
        if kind == "add":
            new += [(rid, prompts, params, first, images[0] if images else None)
                    for rid, prompts, params, first, *images in arg]
        else:
            sync(arg)
    while len(done) < 4:
        take(step(new))
        new = []
    return done


def reference(path: str) -> dict:
    engine = engine_of(load(path))
    replica = Lockstep(engine, replica_groups(1), None, timeout_s=JOIN_S)       # (one rank: the engine alone)

    def sync(version):
        assert replica.interrupt() > 0                    # in-flight samples: the partial rollout is exercised
        engine.load_weights(new_weights(path, load), version=version)

    return play(replica.step, sync, script_of(path))


def run_ranks(body, path: str, sender=None):
    """`body(rank, sync_ports, path)` on the 2 gloo ranks of a replica (forkserver processes; the sync's sender, the
    trainer's rank 0, `sender(sync_ports, path)`, is a thread of rank 0's process): rank 0's result."""
    ctx = mp.get_context("forkserver")      # one server imports torch and lathe once; each rank is a fork of it
    ctx.set_forkserver_preload([__name__])
    queue, port, sync_ports = ctx.Queue(), free_port(), (free_port(), free_port())
    procs = [ctx.Process(target=rank_main, args=(body, sender or send, r, port, sync_ports, path, queue), daemon=True)
             for r in range(2)]
    return run_processes(procs, queue, 3 * JOIN_S)[0]


def rank_main(body, sender, rank: int, port: int, sync_ports, path: str, queue) -> None:
    def send():
        try:
            sender(sync_ports, path)
        except BaseException:          # the test fails at once, with the sender's traceback, not at the ranks' timeout
            import traceback
            queue.put((0, f"the sender (a thread of rank 0) failed:\n{traceback.format_exc()}"))
            raise

    def work():
        thread = threading.Thread(target=send) if rank == 0 else None
        if thread is not None:
            thread.start()                               # the trainer's rank 0, sending over the SyncGroup(s)
        result = body(rank, sync_ports, path)
        if thread is not None:
            thread.join(timeout=JOIN_S)
        return result
    gloo_rank(rank, 2, port, queue, work, JOIN_S)


def lockstep_rank(rank: int, sync_ports, path: str):
    tp = replica_groups(2)
    control = control_groups(2, JOIN_S)
    quick = control_groups(2, 0.5)                   # (for the silent leader at the end)
    failing = control_groups(2, JOIN_S)              # (for the leader that fails, last)
    engine = engine_of(shard_copy(load(path), torch.float32, torch.device("cpu"), tp))
    replica = Lockstep(engine, tp, control, timeout_s=JOIN_S)
    group = SyncGroup("127.0.0.1", sync_ports[0], 1 + rank, 3, device=torch.device("cpu"), timeout_s=JOIN_S)

    def receive(args):
        return receive_weights(group, args["metas"], bucket_bytes=args["bucket_bytes"],
                               consume=lambda named: engine.load_weights(named, version=args["version"]))

    metas = metas_of(load(path).state_dict().items(), torch.float32)
    result = None
    if rank == 0:
        def sync(version):
            assert replica.interrupt() > 0
            replica.load({"metas": metas, "bucket_bytes": 1 << 14, "version": version}, receive)

        result = play(replica.step, sync, script_of(path))
        replica.stop()
        time.sleep(1.5)                              # silent: the follower's quick group times out
        Lockstep(engine, tp, failing, timeout_s=JOIN_S).abort(ValueError("the engine broke"))
    else:
        replica.follow(receive)
        with pytest.raises(TimeoutError, match="rank 1 .* no message from its leader, rank 0"):
            Lockstep(engine, tp, quick, timeout_s=0.5).follow(receive)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="its leader, rank 0, failed: ValueError: the engine broke"):
            Lockstep(engine, tp, failing, timeout_s=JOIN_S).follow(receive)
        assert time.monotonic() - start < JOIN_S / 2      # at once, not at the timeout
    group.close()
    return result


def send(ports, path: str) -> None:
    """Whole tensors to both ranks over one group (each rank cuts its slices)."""
    group = SyncGroup("127.0.0.1", ports[0], 0, 3, device=torch.device("cpu"), timeout_s=JOIN_S)
    named = list(new_weights(path, load))
    send_weights(group, named, metas_of(named, torch.float32), bucket_bytes=1 << 14)
    group.close()


def send_sliced(ports, path: str) -> None:
    """The resharding sync (`lathe.workers.reshard`): each position's slices over its own group."""
    groups = [SyncGroup("127.0.0.1", port, 0, 2, device=torch.device("cpu"), timeout_s=JOIN_S) for port in ports]
    named = list(new_weights(path))
    send_resharded(groups, layouts(path), named, metas_of(named, torch.float32), bucket_bytes=1 << 14)
    for group in groups:
        group.close()


def layouts(path: str):
    return position_layouts(load_lathe_model(path, torch.float32).config, 2)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "deepseek_v3", "qwen2_5_vl"])
def test_a_tensor_parallel_replica_streams_what_one_engine_streams(tmp_path, family):
    """Also a hybrid (Qwen3.5: each rank's linear-attention states of its key heads, through the interrupt, where the
    partial rollout computes them again, and the sync), latent attention (DeepSeek-V3: its heads' latent cache) and
    a vision-language model (Qwen2.5-VL: image prompts, the images sent to the follower with their requests, the
    interrupted ones encoded again by the new vision tower)."""
    if family == "deepseek_v3":
        from models.deepseek_tiny import deepseek_model
        path = str(tmp_path / family)
        deepseek_model(seed=2).save_pretrained(path)
    elif family == "qwen2_5_vl":
        from models.vl_tiny import save_hf as save_vl
        path = str(save_vl(tmp_path, family)[0])
    else:
        from models.lathe_tiny import save_hf
        path = str(save_hf(tmp_path, family, tie=True)[0])  # tied: the LM head's slices come from the embeddings
    want = reference(path)
    assert any(len({v for v, _ in spans}) > 1 for _, _, versions in want.values() for spans in versions)
    assert run_ranks(lockstep_rank, path) == want


def test_a_leaders_engine_refuses_a_request_at_its_add(tmp_path):
    """The leader's engine through its lockstep (`ReplicaEngine`, which the agent loop drives) refuses a request at
    the add, as the engine's own `add_request` does: a loop of data-parallel attention then tells the other replicas
    at its next agreement, before any step (it used to raise at the next `step`, inside the replicas' collectives).
    What it took before the refusal is still stepped, and a request of no tokens comes out of the next step."""
    from models.lathe_tiny import save_hf
    from lathe.workers.lockstep import ReplicaEngine
    engine = engine_of(load_lathe_model(str(save_hf(tmp_path, "llama")[0]), torch.float32))
    leader = ReplicaEngine(Lockstep(engine, replica_groups(1), None, timeout_s=JOIN_S))
    leader.add_request("a", PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="add_request 'b'.*max_model_len=48"):
        leader.add_request("b", [[3] * 48], SamplingParams(max_tokens=2))
    leader.add_request("none", PROMPTS[:1], SamplingParams(max_tokens=0))
    with pytest.raises(RuntimeError, match="'interrupt' while requests it added wait for its followers"):
        leader.replica.interrupt()            # (its followers would add them to an engine in another state)
    finished = []
    while leader.has_unfinished_requests():
        leader.step()
        finished += [rid for rid, _ in leader.pop_finished()]
    assert sorted(finished) == ["a", "none"]


# -- the rollout worker of a tensor-parallel replica (its engine thread, the driver's calls to the leader) -----------

LONG = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)


def responses(batch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]


def worker_rank(rank: int, sync_ports, path: str):
    """Rank 0 drives its replica as the driver does (and sends the weights, as the trainer's rank 0 would)."""
    from types import SimpleNamespace

    from lathe.batch import Batch
    from lathe.config import load_config
    from lathe.workers.fully_async import RolloutWorker
    from workers.test_fully_async import _collect_until
    cfg = load_config("default", ["rollout.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=false",
                                  "data.train_batch_size=0", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                  "actor_rollout_ref.nccl_timeout=4", "data.max_response_length=24"])
    worker = RolloutWorker(cfg, path, {"impl": "auto"}, SimpleNamespace(pad_token_id=0, eos_token_id=2),
                           device_type="cpu")
    worker.join_sync_group("127.0.0.1", sync_ports[rank], 1, 2, JOIN_S)     # (the group of its position)
    result = None
    if rank == 0:
        beats = []
        idle = worker.replica.idle
        worker.replica.idle = lambda: (beats.append(1), idle())
        worker.submit([("a", PROMPTS[:2], LONG, 0)])
        got = _collect_until(worker, {"a"})
        metas = metas_of(load_lathe_model(path, torch.float32).state_dict().items(), torch.float32)
        time.sleep(1.5)                               # idle: a heartbeat every nccl_timeout / 4 = 1 s
        assert worker.pause(partial=True, timeout_s=JOIN_S) == 0
        worker.receive_weights(metas, 1 << 14, 1, [sliced_metas(layout, metas) for layout in layouts(path)])
        worker.resume()
        worker.submit([("b", PROMPTS[2:], LONG, 4)])
        got.update(_collect_until(worker, {"b"}))
        worker.submit([("c", PROMPTS[1:2], LONG, 0)])
        worker.pause(partial=True, timeout_s=JOIN_S)     # (maybe mid-way: continues on the same weights)
        worker.resume()
        got.update(_collect_until(worker, {"c"}))
        validation = worker.generate_sequences(Batch(non_tensors={"prompt_ids": PROMPTS[3:]}), LONG)
        result = ({k: (responses(b), b["rollout_versions"].unique().tolist()) for k, b in got.items()},
                  responses(validation), len(beats))
    else:
        assert worker.generate_sequences(Batch(non_tensors={"prompt_ids": PROMPTS[3:]}), LONG) is None
        with pytest.raises(RuntimeError, match="goes to the replica's leader only"):
            worker.submit([("x", PROMPTS[:1], LONG, 0)])
    worker.shutdown()                               # (the leader's tells its follower's thread to end)
    assert not worker._thread.is_alive() and worker.collect()["done"] == []
    return result


def test_a_tensor_parallel_rollout_worker_follows_its_leader_through_a_sync(tmp_path):
    """The driver's calls go to the leader only; requests before the sync sample what one engine samples with the
    old weights, after it with the new ones (received as each rank's slices: a resharding sync); the idle leader
    sends heartbeats; shutdown ends the follower too."""
    from models.lathe_tiny import save_hf
    path = str(save_hf(tmp_path, "llama", tie=True)[0])
    engine = engine_of(load_lathe_model(path, torch.float32))
    want_a = engine.generate(PROMPTS[:2], LONG).token_ids
    engine.update_weights(new_weights(path))
    want_b = engine.generate(PROMPTS[2:], LONG, first_index=4).token_ids
    want_val = engine.generate(PROMPTS[3:], LONG).token_ids
    got, validation, beats = run_ranks(worker_rank, path, send_sliced)
    assert got["a"] == (want_a, [0]) and got["b"] == (want_b, [1])
    # c may have been interrupted mid-way (timing): recomputed KV may move its later tokens by the last bits
    assert [len(t) for t in got["c"][0]] == [24, 24] and got["c"][1] == [1]
    assert validation == want_val and beats >= 1


class FakeGroup:
    """`RayWorkerGroup`'s calls, recorded: each rank answers (method, its rank)."""

    def __init__(self, world_size: int):
        self.world_size, self.calls = world_size, []

    def call(self, role, method, *args, **kwargs):
        return self.call_each(role, method, [(args, kwargs)] * self.world_size)

    def call_each(self, role, method, per_rank):
        return self.gather(self.submit_each(role, method, per_rank), method)

    def submit_each(self, role, method, per_rank):
        self.calls.append((method, [r for r, a in enumerate(per_rank) if a is not None]))
        answers = {"collect": lambda r: {"done": [(r, None)] * (r % 2 == 0), "busy_s": float(r)}, "pause": lambda r: 1}
        return [None if a is None else answers.get(method, lambda r: r)(r) for r, a in enumerate(per_rank)]

    def gather(self, refs, what, watching=None):
        return refs


def test_the_driver_talks_to_the_leaders_of_the_replicas():
    from lathe.cluster import AsyncCluster
    from lathe.cluster.async_roles import RolloutGroup
    ranks = FakeGroup(6)
    replicas = RolloutGroup(ranks, pad_id=0, timeout_s=1, tp=2)
    assert replicas.world == 3
    replicas.submit({1: ["request"]})
    assert replicas.collect(0.0) == ([(0, None), (2, None), (4, None)], [0.0, 2.0, 4.0])   # busy: the leaders'
    assert replicas.pause(partial=True) == 3
    replicas.resume()
    AsyncCluster(FakeGroup(1), ranks, None, None, replicas, False, [], 1).sync(1)
    assert ranks.calls == [("submit", [2]), ("collect", [0, 1, 2, 3, 4, 5]), ("pause", [0, 2, 4]),
                           ("resume", [0, 2, 4]), ("receive_weights", [0, 2, 4])]   # (followers: told by leaders)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 does not divide the rollout pool's 6 ranks"):
        RolloutGroup(ranks, pad_id=0, timeout_s=1, tp=4)


# -- multi-turn trajectories on a tensor-parallel rollout worker (`ReplicaEngine`: the agent stream on the leader) ----

AGENT_TURNS = SamplingParams(n=3, temperature=1.0, max_tokens=64, seed=5)


def agent_worker(cfg_overrides: list[str], path: str, patch=setattr):
    """A rollout worker of the `agent_demo` task as `workers.test_lockstep_agent.agent_demo` runs it, its request
    (the two prompts, AGENT_TURNS), and the list of the tool's calls in this process."""
    from lathe.config import load_config
    from lathe.workers.fully_async import RolloutWorker, request_agent
    from workers.test_lockstep_agent import agent_demo
    tokenizer, prompts, calls = agent_demo(patch)
    cfg = load_config("agent_demo", ["actor_rollout_ref.hybrid_engine=false", "data.train_batch_size=0",
                                     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", *cfg_overrides])
    worker = RolloutWorker(cfg, path, {"impl": "auto"}, tokenizer, device_type="cpu")
    request = ("r", [list(p) for p in prompts["prompt_ids"]], AGENT_TURNS, 0, None, request_agent(prompts))
    return worker, request, calls


def agent_record(batch) -> tuple:
    return responses(batch), list(batch["tool_calls"]), list(batch["num_turns"])


def agent_rank(rank: int, path: str):
    import random

    from workers.test_fully_async import _collect_until
    random.seed(rank)
    worker, request, calls = agent_worker(["rollout.n_gpus_per_node=2",
                                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], path)
    result = None
    if rank == 0:
        worker.submit([request])
        result = (agent_record(_collect_until(worker, {"r"})["r"]), len(calls))
    worker.shutdown()
    return result if rank == 0 else len(calls)


def agent_rank_main(rank: int, port: int, path: str, queue) -> None:
    gloo_rank(rank, 2, port, queue, lambda: agent_rank(rank, path), JOIN_S)


def test_a_tensor_parallel_rollout_worker_runs_multi_turn_trajectories_once_on_its_leader(tmp_path, monkeypatch):
    """The leader's agent stream runs the tools (the follower none) and its turns reach the follower's engine with
    each step: the trajectories are one worker's, token for token, tool call for tool call."""
    from lathe.config import load_config
    from lathe.loop.setup import _given_model
    from lathe.models.hf import load_policy, load_tokenizer
    from workers.test_fully_async import _collect_until
    cfg = load_config("agent_demo", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                     "data.train_batch_size=0"])
    path, kwargs = _given_model(cfg, load_tokenizer("builtin:tiny"))
    load_policy(path, **kwargs).save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    worker, request, calls = agent_worker(["rollout.n_gpus_per_node=1"], path, monkeypatch.setattr)
    worker.submit([request])
    want = agent_record(_collect_until(worker, {"r"})["r"])
    worker.shutdown()
    assert 0 < sum(want[1]) and len(calls) == sum(want[1]) and max(want[2]) > 3     # several tool turns
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=agent_rank_main, args=(r, port, path, queue), daemon=True) for r in range(2)]
    got = run_processes(procs, queue, 3 * JOIN_S)
    assert got[0] == (want, sum(want[1])) and got[1] == 0
