"""A resharding weight sync: each rank of a tensor-parallel rollout replica receives only the slices it keeps.

With `rollout.tensor_model_parallel_size` = T > 1 the sync runs one `SyncGroup` per tensor-parallel position p
(0..T-1): the trainer's rank 0 (rank 0 of every group) and the rank at position p of every replica (rank 1 + i of
group p for replica i). The trainer cuts each whole tensor it gathers into the T slices of `ShardLayout.local_items`
(columns, rows, vocabulary rows, experts; a tied model's embeddings also give the LM head; norms, embeddings and
routers whole), with layouts built from the model's config alone (`position_layouts`), and packs slice p into group
p's buckets (`BucketSender`: the plan of the slices' metas, `sliced_metas`). The T groups' broadcasts overlap: each
group's broadcasts are asynchronous, and the trainer packs tensor after tensor into every group in turn, so one
gathered tensor feeds all T groups before the next is gathered. A receiver copies what arrives into its model as
it is (`LatheEngine.load_weights(..., local=True)`): no cut on receipt, and 1/T of the sliced tensors' bytes (plus
the whole ones) on each rank instead of all of them.

T = 1 is the plain sync: one group, whole tensors (`send_weights` / `receive_weights`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from lathe.engine.tensor_parallel import ShardLayout, TensorParallel
from lathe.models.config import LatheConfig
from lathe.workers.checkpoint_engine import BucketSender, SyncGroup, TensorMeta, check_tensor, one_more


def position_layouts(cfg: LatheConfig, size: int, expert_parallel_size: int = 1,
                     keep_mtp: bool = False) -> list[ShardLayout]:
    """The `ShardLayout` of each position of a replica of `size` ranks, from the model's config alone (the
    trainer's side: no engine model, no process group); `keep_mtp`: the replicas hold the MTP layers whole
    (speculative decoding), so they are sent whole to each."""
    return [ShardLayout(cfg, TensorParallel(None, p, size), expert_parallel_size, keep_mtp) for p in range(size)]


def position_label(position: int, size: int) -> str:
    """How the errors of a resharding sync's group name it ("" for the one group of a plain sync)."""
    return f"tensor-parallel position {position} of {size}" if size > 1 else ""


def join_as_sender(model, host: str, port: int | list[int], rank: int, world_size: int, *, device: torch.device,
                   timeout_s: float, expert_parallel_size: int = 1, keep_mtp: bool = False
                   ) -> tuple[list[SyncGroup], list | None]:
    """The trainer's rank 0 joins the sync: one group (one port), or a resharding sync's T groups (T ports, in
    position order) and the T positions' layouts (from the config of the trainer's `model`)."""
    ports = port if isinstance(port, list) else [port]
    size = len(ports)
    layouts = (position_layouts(replica_config(model, size), size, expert_parallel_size, keep_mtp) if size > 1
               else None)
    groups = [SyncGroup(host, each, rank, world_size, device=device, timeout_s=timeout_s,
                        label=position_label(p, size)) for p, each in enumerate(ports)]
    return groups, layouts


def replica_config(model, size: int) -> LatheConfig:
    """The lathe config of the trainer's `model` (a VL model's language model's), which the replicas' layouts are
    cut from (a VL model's vision tower goes whole to every rank)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text", cfg)
    if not isinstance(cfg, LatheConfig):
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={size}: the resharding weight sync cuts the "
            f"trainer's tensors by lathe's decoder config, and the trainer runs {type(model).__name__}. Fix: "
            "actor_rollout_ref.model.impl=auto (lathe's decoder), or set it to 1")
    return cfg


def sliced_metas(layout: ShardLayout, metas: list[TensorMeta]) -> list[TensorMeta]:
    """The metas of the slices that `layout`'s position keeps of the whole tensors of `metas`, in sending order
    (the cut of `ShardLayout.local_items`, run on meta tensors: shapes only)."""
    seen: set[str] = set()
    return [TensorMeta(name, tuple(t.shape), t.dtype) for m in metas
            for name, t in _slices(layout, m.name, torch.empty(m.shape, dtype=m.dtype, device="meta"), seen)]


def _slices(layout: ShardLayout, name: str, tensor: torch.Tensor, seen: set[str]):
    """`layout`'s slices of one whole tensor, less those already sent (a tied model's LM head comes from its
    embeddings: a trainer that also lists lm_head.weight would send it twice)."""
    for local_name, piece in layout.local_items([(name, tensor)]):
        if local_name not in seen:
            seen.add(local_name)
            yield local_name, piece


def send_resharded(groups: list[SyncGroup], layouts: list[ShardLayout],
                   named_tensors: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta], *,
                   bucket_bytes: int) -> dict[str, float]:
    """The trainer's rank 0: each whole tensor of `named_tensors` (consumed lazily, in the order of `metas`; each cut
    before the next is asked for, which may free it: FSDP2's gathered layers) by every position's layout, position
    p's slices broadcast over `groups[p]` (module doc).

    Returns {"bytes": what rank 0 sent over all groups, "rank_bytes": the most one rollout rank received,
    "seconds", "buckets", "positions"}."""
    start = time.perf_counter()
    senders: list[BucketSender] = []
    tensors = iter(named_tensors)
    seen: list[set[str]] = [set() for _ in layouts]
    try:
        for group, layout in zip(groups, layouts, strict=True):
            senders.append(BucketSender(group, sliced_metas(layout, metas), bucket_bytes))
        count = 0
        for name, tensor in tensors:
            if count == len(metas):
                raise one_more(name, len(metas))
            check_tensor(metas[count], name, tensor, count)
            count += 1
            for layout, sender, sent in zip(layouts, senders, seen):
                for local_name, piece in _slices(layout, name, tensor, sent):
                    sender.push(local_name, piece)
        stats = [sender.finish() for sender in senders]
    except BaseException as e:
        message = f"{type(e).__name__}: {e}"
        for group in groups:       # every group's receivers raise it (a group whose sync never began included)
            group.fail(message)
        raise
    return {"bytes": sum(s["bytes"] for s in stats), "rank_bytes": max(s["bytes"] for s in stats),
            "seconds": time.perf_counter() - start, "buckets": sum(s["buckets"] for s in stats),
            "positions": float(len(groups))}


def check_slices(model: torch.nn.Module, metas: list[TensorMeta], who: str) -> None:
    """Raise naming the first slice of `metas` whose shape is not that of `model`'s tensor of the name (the trainer
    cut for another layout): copied as it is, it would fail or broadcast."""
    params = model.state_dict(keep_vars=True)
    for m in metas:
        have = params.get(m.name)
        if have is None or tuple(have.shape) != m.shape:
            raise ValueError(f"{who}: the trainer sends {m.name!r} as a slice of shape {m.shape}, and this rank's "
                             f"engine holds {None if have is None else tuple(have.shape)}: the two sides cut the "
                             "weights for different layouts (rollout.tensor_model_parallel_size / "
                             "expert_parallel_size or the model differ)")
