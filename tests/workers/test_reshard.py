"""lathe.workers.reshard: a resharding weight sync into tensor-parallel rollout replicas. The trainer's rank 0 and
every rank of two TP=2 replicas are threads of this process, each with its own gloo `SyncGroup` (one group per
tensor-parallel position); after a sync every rank's sharded model holds, bit for bit, its slices of the trainer's
whole weights in bf16, and received only those bytes: half of each cut tensor, norms and embeddings whole."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from helpers import free_port
from lathe.engine.tensor_parallel import TensorParallel, shard_copy
from lathe.models import load_lathe_model
from lathe.models.io import copy_named_tensors
from lathe.workers.checkpoint_engine import SyncGroup, TensorMeta, metas_of, receive_weights, send_weights
from lathe.workers.fully_async import AsyncTrainerWorker
from lathe.workers.reshard import position_label, position_layouts, send_resharded, sliced_metas

JOIN_S = 60
SIZE, REPLICAS = 2, 2
DTYPE = torch.bfloat16


def changed(model) -> list[tuple[str, torch.Tensor]]:
    """The trainer's whole weights after an update (float32; the sync casts them to the rollout's bf16)."""
    gen, new = torch.Generator().manual_seed(1), {}
    for t in model.state_dict().values():       # a tied model's embeddings and LM head stay one tensor
        if t.data_ptr() not in new:
            new[t.data_ptr()] = t + 0.1 * torch.randn(t.shape, generator=gen)
    return [(n, new[t.data_ptr()]) for n, t in model.state_dict().items()]


def freeing(named):
    """Each tensor a fresh copy whose storage is freed once the next one is asked for (as FSDP2's gathered layers
    are): a sender that looks ahead before it packs a tensor fails."""
    for name, t in named:
        copy = t.clone()
        yield name, copy
        copy.untyped_storage().resize_(0)


def ports(n: int) -> list[int]:
    out: set[int] = set()
    while len(out) < n:
        out.add(free_port())
    return sorted(out)


def sync(path: str, ep: int = 1, load=load_lathe_model) -> tuple[dict, dict, dict, list]:
    """One resharding sync from the trainer's rank 0 to REPLICAS replicas of SIZE ranks: (the sender's stats, {(replica,
    position): received stats}, {(replica, position): the rank's state after it}, the whole weights sent)."""
    base = load(path, torch.float32)
    whole = changed(base)
    metas = metas_of(whole, DTYPE)
    layouts = position_layouts(getattr(base.config, "text", base.config), SIZE, ep)
    at = ports(SIZE)
    models = {(i, p): shard_copy(base, DTYPE, torch.device("cpu"), TensorParallel(None, p, SIZE),
                                 expert_parallel_size=ep) for i in range(REPLICAS) for p in range(SIZE)}

    def receiver(i: int, p: int) -> dict:
        group = SyncGroup("127.0.0.1", at[p], 1 + i, 1 + REPLICAS, device=torch.device("cpu"), timeout_s=JOIN_S)
        try:
            return receive_weights(group, sliced_metas(layouts[p], metas), bucket_bytes=4096,
                                   consume=lambda named: copy_named_tensors(models[i, p], named, who="test"))
        finally:
            group.close()

    with ThreadPoolExecutor(len(models)) as pool:
        futures = {key: pool.submit(receiver, *key) for key in models}
        # the trainer's rank 0 (`AsyncTrainerWorker` over a stand-in of the actor worker: its model and weights)
        actor = SimpleNamespace(model=base, weights=lambda: freeing(whole))
        trainer = AsyncTrainerWorker(SimpleNamespace(actor=actor, device=torch.device("cpu")), DTYPE)
        trainer.join_sync_group("127.0.0.1", at, 0, 1 + REPLICAS, JOIN_S, expert_parallel_size=ep)
        assert trainer.position_metas(metas) == [sliced_metas(layout, metas) for layout in layouts]
        sent = trainer.send_weights(metas, 4096)
        received = {key: f.result(timeout=JOIN_S) for key, f in futures.items()}
    trainer.close_sync()
    return sent, received, {key: m.state_dict() for key, m in models.items()}, whole


def expected_rank_bytes(whole, vocab: int, whole_names) -> int:
    """What one rank keeps, counted from the names (independent of the layout's code): half of each cut tensor,
    the LM head's padded half of the vocabulary rows, the tensors in `whole_names` whole."""
    total = 0
    for name, t in whole:
        n = t.numel() * DTYPE.itemsize
        if name == "lm_head.weight":
            n = -(-vocab // SIZE) * t.shape[1] * DTYPE.itemsize
        elif not (t.dim() == 1 or name in whole_names or name.endswith("mlp.gate.weight")):
            n //= SIZE
        total += n
    return total


def check(path: str, ep: int = 1) -> None:
    sent, received, states, whole = sync(path, ep)
    full = dict(whole)
    hidden = full["model.embed_tokens.weight"].shape[1]
    vocab = full["model.embed_tokens.weight"].shape[0]
    head = full.get("lm_head.weight", full["model.embed_tokens.weight"])
    for (i, p), state in states.items():
        # the slices by hand: q rows of this position's heads, the head's vocabulary rows (the last ones padded)
        q = full["model.layers.0.self_attn.q_proj.weight"]
        rows = q.shape[0] // SIZE
        assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], q[p * rows:(p + 1) * rows].to(DTYPE))
        o = full["model.layers.0.self_attn.o_proj.weight"]
        cols = o.shape[1] // SIZE
        assert torch.equal(state["model.layers.0.self_attn.o_proj.weight"], o[:, p * cols:(p + 1) * cols].to(DTYPE))
        per = -(-vocab // SIZE)
        mine = head[p * per:(p + 1) * per].to(DTYPE)
        assert torch.equal(state["lm_head.weight"][:mine.shape[0]], mine)
        assert not state["lm_head.weight"][mine.shape[0]:].any()
        assert torch.equal(state["model.norm.weight"], full["model.norm.weight"].to(DTYPE))
        # every tensor: the engine's own cut (shard_copy) of the new whole weights in bf16, bit for bit
        want = shard_copy(load_lathe_model(path, torch.float32), DTYPE, torch.device("cpu"),
                          TensorParallel(None, p, SIZE), state=whole, expert_parallel_size=ep).state_dict()
        assert state.keys() == want.keys()
        for name in want:
            assert torch.equal(state[name], want[name]), (i, p, name)
        assert received[i, p]["bytes"] == expected_rank_bytes(whole, vocab, {"model.embed_tokens.weight"})
    total = sum(t.numel() for _, t in whole) * DTYPE.itemsize
    assert sent["rank_bytes"] == received[0, 0]["bytes"] < 0.7 * total
    assert sent["bytes"] == sum(received[0, p]["bytes"] for p in range(SIZE))
    assert hidden and sent["positions"] == SIZE


def test_each_rank_of_two_dense_replicas_receives_its_slices(tmp_path):
    from models.lathe_tiny import save_hf
    check(str(save_hf(tmp_path, "llama", tie=True)[0]))       # tied: the LM head's slices from the embeddings


def test_each_rank_of_two_moe_replicas_receives_its_experts(tmp_path):
    from models.lathe_tiny import MOE, save_hf
    check(str(save_hf(tmp_path, MOE)[0]), ep=SIZE)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "deepseek_v3"])
def test_each_rank_of_two_hybrid_or_latent_replicas_receives_its_heads_and_shared_expert_share(tmp_path, family):
    """Qwen3.5 and Qwen3-Next (linear attention, gated attention; Qwen3-Next's shared experts), DeepSeek-V3 (latent
    attention, shared experts): every rank's model after the sync is the engine's own cut of the new whole weights,
    bit for bit, and the ranks' bytes add up to what the trainer sent."""
    if family == "deepseek_v3":
        from models.deepseek_tiny import deepseek_model
        path = str(tmp_path / family)
        deepseek_model(seed=2).save_pretrained(path)
    else:
        from models.lathe_tiny import save_hf
        path = str(save_hf(tmp_path, family)[0])
    ep = SIZE if load_lathe_model(path, torch.float32).config.moe is not None else 1
    sent, received, states, whole = sync(path, ep)
    assert_engine_cuts(states, path, whole, ep)
    assert any(("linear_attn" if family != "deepseek_v3" else "kv_b_proj") in name for name in states[0, 0])
    assert sent["bytes"] == sum(received[0, p]["bytes"] for p in range(SIZE))


def assert_engine_cuts(states: dict, path: str, whole, ep: int, load=load_lathe_model) -> None:
    """Every rank's state after the sync is the engine's own cut (shard_copy) of the new whole weights, bit for bit."""
    for (i, p), state in states.items():
        want = shard_copy(load(path, torch.float32), DTYPE, torch.device("cpu"), TensorParallel(None, p, SIZE),
                          state=whole, expert_parallel_size=ep).state_dict()
        assert state.keys() == want.keys()
        for name in want:
            assert torch.equal(state[name], want[name]), (i, p, name)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_moe"])
def test_each_rank_of_two_vl_replicas_receives_its_language_model_slices_and_the_whole_vision_tower(tmp_path, family):
    """A vision-language model's replicas (fully-asynchronous training, `rollout.tensor_model_parallel_size`): every
    rank's model after the sync is the engine's own cut of the new whole weights (its language model's slices under
    the VL model's names, the vision tower whole), bit for bit."""
    from lathe.models.vl import load_lathe_vl_model
    from models.vl_tiny import save_hf
    path = str(save_hf(tmp_path, family)[0])
    ep = SIZE if family.endswith("moe") else 1
    sent, received, states, whole = sync(path, ep, load=load_lathe_vl_model)
    assert_engine_cuts(states, path, whole, ep, load=load_lathe_vl_model)
    for state in states.values():
        tower = [n for n in state if n.startswith("model.visual.")]
        assert tower and all(torch.equal(state[n], dict(whole)[n].to(DTYPE)) for n in tower)
    assert sent["bytes"] == sum(received[0, p]["bytes"] for p in range(SIZE))


def test_a_position_group_names_its_missing_rank():
    with pytest.raises(TimeoutError, match=r"position 1 of 2\): receiver rank\(s\) \[1\] \(rollout replicas \[0\]"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, device=torch.device("cpu"), timeout_s=1,
                  label="tensor-parallel position 1 of 2")


class Recorder:
    """A worker group that records each rank's call arguments (`RayWorkerGroup.submit_each`) and answers {}."""

    def __init__(self, world_size: int):
        self.world_size, self.args = world_size, {}

    def submit_each(self, role, method, per_rank):
        self.args[method] = [None if a is None else a[0] for a in per_rank]
        return per_rank

    def gather(self, refs, what, watching=None):
        return [{} for _ in refs]


def test_the_cluster_joins_each_rollout_rank_to_the_group_of_its_position():
    from lathe.cluster import AsyncCluster, _join_sync_group
    from lathe.cluster.async_roles import RolloutGroup
    trainer, rollout = Recorder(2), Recorder(4)               # 2 replicas of TP=2: ranks (0, 1) and (2, 3)
    _join_sync_group(trainer, rollout, "h", [11, 12], 5.0, expert_parallel_size=2)
    assert trainer.args["join_sync_group"] == [("h", [11, 12], 0, 3, 5.0, 2)] * 2     # (rank 0 joins; others skip)
    assert rollout.args["join_sync_group"] == [("h", 11, 1, 3, 5.0), ("h", 12, 1, 3, 5.0),
                                               ("h", 11, 2, 3, 5.0), ("h", 12, 2, 3, 5.0)]
    cluster = AsyncCluster(trainer, rollout, None, None, RolloutGroup(rollout, pad_id=0, timeout_s=1, tp=2), False,
                           ["whole"], 7, [["slices 0"], ["slices 1"]])
    cluster.sync(3)
    told = (["whole"], 7, 3, [["slices 0"], ["slices 1"]])   # (the leaders pass the slices' metas to followers)
    assert rollout.args["receive_weights"] == [told, None, told, None]
    assert trainer.args["send_weights"] == [(["whole"], 7)] * 2


def test_a_failed_send_fails_the_receivers_of_every_position(tmp_path):
    """A tensor that does not match the plan (here the last one, misnamed): the sender raises naming it, and the
    ranks of both positions raise its error instead of waiting out the timeout."""
    from models.lathe_tiny import save_hf
    model = load_lathe_model(str(save_hf(tmp_path, "llama")[0]), torch.float32)
    whole = list(model.state_dict().items())
    metas = metas_of(whole, DTYPE)
    layouts = position_layouts(model.config, SIZE)
    at = ports(SIZE)

    def receiver(p: int):
        group = SyncGroup("127.0.0.1", at[p], 1, 2, device=torch.device("cpu"), timeout_s=JOIN_S)
        try:
            with pytest.raises(RuntimeError, match="the weight sync failed: .*'wrong' but the plan expects"):
                receive_weights(group, sliced_metas(layouts[p], metas), bucket_bytes=1 << 20, consume=lambda _: None)
        finally:
            group.close()

    with ThreadPoolExecutor(SIZE) as pool:
        futures = [pool.submit(receiver, p) for p in range(SIZE)]
        groups = [SyncGroup("127.0.0.1", port, 0, 2, device=torch.device("cpu"), timeout_s=JOIN_S) for port in at]
        with pytest.raises(ValueError, match="'wrong' but the plan expects 'lm_head.weight'"):
            send_resharded(groups, layouts, whole[:-1] + [("wrong", whole[-1][1])], metas, bucket_bytes=1 << 20)
        for f in futures:
            f.result(timeout=JOIN_S)
    for group in groups:
        group.close()


@pytest.mark.parametrize("silent", [0, 1])
def test_a_broadcast_that_times_out_names_the_rank_that_did_not_reach_it(silent):
    """A rank joins its group, then never sends (rank 0) or never receives (rank 1): the other one's wait for a
    bucket times out naming it (each rank marks in the store the bucket it posts)."""
    metas = [TensorMeta(f"t{i}", (1000,), torch.float32) for i in range(8)]      # 4 kB each: 8 buckets
    port, label = free_port(), position_label(1, 2)
    with ThreadPoolExecutor(1) as pool:
        idle = pool.submit(lambda: SyncGroup("127.0.0.1", port, silent, 2, device=torch.device("cpu"), timeout_s=9,
                                             label=label))
        group = SyncGroup("127.0.0.1", port, 1 - silent, 2, device=torch.device("cpu"), timeout_s=1, label=label)
        who = (r"the sender \(rank 0, the trainer's rank 0\)" if silent == 0
               else r"receiver rank\(s\) \[1\] \(rollout replicas \[0\]\)")
        with pytest.raises(TimeoutError, match=rf"position 1 of 2\): {who} did not reach bucket 0 of weight sync #1"):
            if silent == 0:
                receive_weights(group, metas, bucket_bytes=4096, consume=lambda _: None)
            else:
                send_weights(group, [(m.name, torch.ones(1000)) for m in metas], metas, bucket_bytes=4096)
        group.close()
        idle.result(timeout=JOIN_S).close()


def test_the_plain_sync_packs_each_tensor_before_asking_for_the_next():
    metas = [TensorMeta(f"t{i}", (1000,), torch.float32) for i in range(8)]
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, device=torch.device("cpu"), timeout_s=JOIN_S)
    assert send_weights(group, freeing((m.name, torch.ones(1000)) for m in metas), metas,
                        bucket_bytes=4096)["buckets"] == 8
    group.close()


def test_the_backends_own_timeout_messages_are_read_as_timeouts():
    """A broadcast whose backend times out first (Gloo's own timeout equals the group's) is reported as the group's
    timeout, naming who did not answer: both ways Gloo words it (CI, 2026-12-01: "Timed out waiting 1000ms for send
    operation to complete" was raised as it was)."""
    from lathe.workers.checkpoint_engine import _BACKEND_TIMEOUT
    for message in ("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 1000ms for send operation to "
                    "complete", "Application timeout caused pair closure", "Watchdog caught collective operation "
                    "timeout"):
        assert _BACKEND_TIMEOUT.search(message), message
    assert not _BACKEND_TIMEOUT.search("Connection closed by peer [127.0.0.1]:1234")
