"""lathe.workers.reshard: a resharding weight sync into tensor-parallel rollout replicas. The trainer's rank 0 and
every rank of two TP=2 replicas are threads of this process, each with its own gloo `SyncGroup` (one group per
tensor-parallel position); after a sync every rank's sharded model holds, bit for bit, its slices of the trainer's
whole weights in bf16, and received only those bytes: half of each cut tensor, norms and embeddings whole."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import free_port
from lathe.engine.tensor_parallel import TensorParallel, shard_copy
from lathe.models import load_lathe_model
from lathe.models.io import copy_named_tensors
from lathe.workers.checkpoint_engine import SyncGroup, metas_of, receive_weights
from lathe.workers.reshard import position_layouts, send_resharded, sliced_metas

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


def ports(n: int) -> list[int]:
    out: set[int] = set()
    while len(out) < n:
        out.add(free_port())
    return sorted(out)


def sync(path: str, ep: int = 1) -> tuple[dict, dict, dict, list]:
    """One resharding sync from a sender to REPLICAS replicas of SIZE ranks: (the sender's stats, {(replica,
    position): received stats}, {(replica, position): the rank's state after it}, the whole weights sent)."""
    base = load_lathe_model(path, torch.float32)
    whole = changed(base)
    metas = metas_of(whole, DTYPE)
    layouts = position_layouts(base.config, SIZE, ep)
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
        groups = [SyncGroup("127.0.0.1", port, 0, 1 + REPLICAS, device=torch.device("cpu"), timeout_s=JOIN_S)
                  for port in at]
        sent = send_resharded(groups, layouts, iter(whole), metas, bucket_bytes=4096)
        received = {key: f.result(timeout=JOIN_S) for key, f in futures.items()}
    for group in groups:
        group.close()
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


def test_a_position_group_names_its_missing_rank():
    with pytest.raises(TimeoutError, match=r"position 1 of 2\): receiver rank\(s\) \[1\] \(rollout replicas \[0\]"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, device=torch.device("cpu"), timeout_s=1,
                  label="tensor-parallel position 1 of 2")
