"""lathe.workers.checkpoint_engine: the bucket plan, and bit-equal weight sync from one sender to two receivers
in separate processes, each with its own default process group (Gloo on CPU; NCCL across GPUs)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, needs_gpus, run_processes

from lathe.workers.checkpoint_engine import (ALIGN, SyncGroup, TensorMeta, bucket_layout, bucket_plan, check_tensor,
                                             metas_of, receive_weights, send_weights)

UPDATES = 3
BUCKET_BYTES = 4096
JOIN_S = 60          # every wait in these tests is bounded: a broken sync fails, it never hangs the suite


def meta(name: str, numel: int, dtype=torch.float32) -> TensorMeta:
    return TensorMeta(name, (numel,), dtype)


# -- the plan ---------------------------------------------------------------------------------------------
def test_bucket_plan_keeps_order_and_bounds_sizes():
    metas = [meta(f"t{i}", n) for i, n in enumerate([10, 200, 7, 64, 150, 1, 90, 250, 3, 3])]   # 4-byte elements
    plan = bucket_plan(metas, 1024)
    assert [m for b in plan for m in b] == metas
    assert len(plan) > 1
    for bucket in plan:
        offsets, size = bucket_layout(bucket)
        assert size <= 1024
        assert all(o % ALIGN == 0 for o in offsets)
        ends = [o + m.nbytes for o, m in zip(offsets, bucket)]
        assert all(e <= o for e, o in zip(ends, offsets[1:]))   # no overlap
        assert size == ends[-1]


def test_bucket_plan_puts_an_oversize_tensor_alone():
    metas = [meta("a", 10), meta("big", 1000), meta("b", 10), meta("c", 10)]
    plan = bucket_plan(metas, 1024)
    assert [[m.name for m in b] for b in plan] == [["a"], ["big"], ["b", "c"]]
    assert bucket_layout(plan[1])[1] == 4000


def test_bucket_plan_edge_cases():
    assert bucket_plan([], 1024) == []
    scalar = TensorMeta("s", (), torch.bfloat16)
    assert scalar.nbytes == 2 and TensorMeta("e", (0, 5), torch.float32).nbytes == 0
    assert bucket_layout([scalar, scalar])[0] == [0, ALIGN]
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_plan([scalar], 0)


def test_metas_of_casts_floating_tensors_only():
    named = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16)),
             ("step", torch.zeros(1, dtype=torch.int64))]
    assert metas_of(named, torch.bfloat16) == [TensorMeta("w", (2, 3), torch.bfloat16),
                                               TensorMeta("b", (3,), torch.bfloat16),
                                               TensorMeta("step", (1,), torch.int64)]
    assert metas_of(named)[0].dtype == torch.float32


def test_a_tensor_that_does_not_match_the_plan_is_named():
    m = TensorMeta("layers.0.q.weight", (4, 8), torch.bfloat16)
    check_tensor(m, "layers.0.q.weight", torch.zeros(4, 8), 0)
    with pytest.raises(ValueError, match=r"tensor #3 is 'layers.0.k.weight' but the plan expects 'layers.0.q.weight'"):
        check_tensor(m, "layers.0.k.weight", torch.zeros(4, 8), 3)
    with pytest.raises(ValueError, match=r"'layers.0.q.weight' has shape \(8, 4\)"):
        check_tensor(m, "layers.0.q.weight", torch.zeros(8, 4), 0)
    with pytest.raises(ValueError, match="integer"):
        check_tensor(m, "layers.0.q.weight", torch.zeros(4, 8, dtype=torch.int64), 0)


def test_send_weights_rejects_a_wrong_iterator_on_a_group_of_one():
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, device=torch.device("cpu"), timeout_s=JOIN_S)
    try:
        state = model_state(0)
        metas = metas_of(state.items())
        stats = send_weights(group, state.items(), metas, bucket_bytes=BUCKET_BYTES)
        assert stats["bytes"] == sum(m.nbytes for m in metas)
        wrong = list(state.items())
        wrong[2] = ("lm_head.weight", wrong[2][1])
        with pytest.raises(ValueError, match="lm_head.weight"):
            send_weights(group, iter(wrong), metas, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(RuntimeError, match="failed earlier"):   # a failed group says so from then on
            send_weights(group, state.items(), metas, bucket_bytes=BUCKET_BYTES)
    finally:
        group.close()
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, device=torch.device("cpu"), timeout_s=JOIN_S)
    try:
        with pytest.raises(ValueError, match="ran out before"):
            send_weights(group, list(state.items())[:-1], metas, bucket_bytes=BUCKET_BYTES)
    finally:
        group.close()
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, device=torch.device("cpu"), timeout_s=JOIN_S)
    try:
        with pytest.raises(ValueError, match="'extra' is one tensor more"):
            send_weights(group, [*state.items(), ("extra", torch.zeros(1))], metas, bucket_bytes=BUCKET_BYTES)
    finally:
        group.close()


def test_a_receiver_that_never_comes_is_named():
    with pytest.raises(TimeoutError, match=r"receiver rank\(s\) \[1\]"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, device=torch.device("cpu"), timeout_s=1)


# -- sync across processes --------------------------------------------------------------------------------
def model_state(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A tiny model-like state: fp32 and bf16 weights, an int64 buffer, one tensor bigger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(40, 16, generator=g),                          # 2560 bytes
             "layers.0.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
             "layers.0.mlp.weight": torch.randn(64, 32, generator=g),                   # 8192 bytes > bucket
             "layers.0.mlp.bias": torch.randn(64, generator=g).to(torch.bfloat16),
             "rope.position_ids": torch.randint(0, 1 << 40, (33,), generator=g),         # int64 buffer
             "norm.weight": torch.randn(16, generator=g)}
    return {k: v.to(device) for k, v in state.items()}


def expected(state: dict[str, torch.Tensor], metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    return {m.name: state[m.name].to(m.dtype) for m in metas}


def sync_worker(rank: int, world: int, port: int, own_port: int, device_type: str, queue) -> None:
    """One process: its own default group of one, then UPDATES syncs; puts (rank, result or traceback)."""
    group = None
    try:
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{own_port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=JOIN_S))
        group = SyncGroup("127.0.0.1", port, rank, world, device=device, timeout_s=JOIN_S)
        metas = metas_of(model_state(0).items(), torch.bfloat16)
        stats, checks = [], []
        model = {m.name: torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas}
        for update in range(UPDATES):
            state = model_state(update + 1, device_type)
            if rank == 0:
                stats.append(send_weights(group, iter(state.items()), metas, bucket_bytes=BUCKET_BYTES))
                continue

            def consume(views):
                for name, view in views:
                    model[name].copy_(view)
            stats.append(receive_weights(group, metas, bucket_bytes=BUCKET_BYTES, consume=consume))
            want = expected(state, metas)
            checks.append({name: bool(torch.equal(model[name], want[name])) for name in want})
        queue.put((rank, {"stats": stats, "checks": checks, "failure": failing_update(group, metas, model, device)}))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def failing_update(group: SyncGroup, metas: list[TensorMeta], model: dict, device: torch.device) -> str:
    """A 4th update whose sender yields a wrong shape mid-way: the sender raises a ValueError naming the tensor,
    and the receivers, already waiting for its bucket, raise it too (within about a second) instead of hanging."""
    try:
        if group.rank == 0:
            state = model_state(9, device.type)
            state["layers.0.mlp.bias"] = state["layers.0.mlp.bias"][:-1]
            send_weights(group, state.items(), metas, bucket_bytes=BUCKET_BYTES)
        else:
            receive_weights(group, metas, bucket_bytes=BUCKET_BYTES,
                            consume=lambda views: [model[n].copy_(v) for n, v in views])
        return "no error"
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:   # rank 0 hosts the store: it stays until every receiver has read the error
        group.store.set(f"seen/{group.rank}", "1")
        group.store.wait([f"seen/{r}" for r in range(group.world_size)], datetime.timedelta(seconds=JOIN_S))


def run_sync(world: int, device_type: str) -> dict[int, dict]:
    ctx = mp.get_context("forkserver")      # one server imports torch and lathe once; each rank is a fork of it
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=sync_worker, args=(r, world, port, free_port(), device_type, queue), daemon=True)
             for r in range(world)]
    return run_processes(procs, queue, 3 * JOIN_S)


def assert_bit_equal(results: dict[int, dict], world: int) -> None:
    metas = metas_of(model_state(0).items(), torch.bfloat16)
    assert sorted(results) == list(range(world))
    for rank in range(1, world):
        assert len(results[rank]["checks"]) == UPDATES
        for update, checks in enumerate(results[rank]["checks"]):
            differ = [k for k, ok in checks.items() if not ok]
            assert not differ, f"rank {rank}, update {update}: {differ} differ from the sender's"
    assert results[0]["failure"].startswith("ValueError: send_weights: 'layers.0.mlp.bias' has shape (63,)")
    for rank in range(1, world):
        assert results[rank]["failure"].startswith("RuntimeError"), results[rank]["failure"]
        want = f"sync #{UPDATES + 1} on rank 0: ValueError: send_weights: 'layers.0.mlp.bias'"
        assert want in results[rank]["failure"]
    for rank in range(world):
        for stats in results[rank]["stats"]:
            assert stats["bytes"] == sum(m.nbytes for m in metas)
            assert stats["buckets"] == len(bucket_plan(metas, BUCKET_BYTES)) >= 3
            assert stats["seconds"] > 0


def test_three_updates_arrive_bit_equal_over_gloo():
    assert_bit_equal(run_sync(3, "cpu"), 3)


@pytest.mark.gpu
@needs_gpus(2)
def test_three_updates_arrive_bit_equal_over_nccl():
    world = torch.cuda.device_count()       # 1 sender (trainer) + the rest receivers (rollout replicas)
    assert_bit_equal(run_sync(world, "cuda"), world)
