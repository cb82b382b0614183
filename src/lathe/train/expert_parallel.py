"""Expert parallelism in training (a role's `fsdp_config.expert_parallel_size`; verl's `megatron.
expert_model_parallel_size`, `torchtitan.expert_parallel_size`, `veomni.expert_parallel_size`), torchtitan's way:
the experts' weights become DTensors cut over the `ep` dim of the model's mesh, the model itself knowing nothing of
it (`lathe.models.moe` runs its experts as a module call over rows sorted by expert; this module wraps that call).

With size P, the W data-parallel ranks form groups of P consecutive ranks (`MeshPlan.ep`, the innermost part of
the shard dim); rank r of a group holds experts [r E/P, (r+1) E/P) of every sparse layer whole (Lepikhin et al.
2020, "GShard", arXiv:2006.16668; Fedus et al. 2021, "Switch Transformer"). Every rank keeps its own data; in each
sparse layer:

- the router and the sorting of the (token, choice) assignments by expert run on the rank's own tokens, as in one
  process (`lathe.models.moe.sorted_forward`): the rows bound for each owner are then one contiguous run;
- the per-expert row counts are exchanged (an all-to-all of E counts), then the rows (an all-to-all with those
  split sizes); the owner orders what it received by local expert (source rank order within an expert) and runs
  its experts on their contiguous runs, with the model's own code;
- the outputs go back by the reverse all-to-all, in the sender's sorted order, and the model puts them back in token
  order and sums each token's k outputs, as in one process.

The all-to-alls are autograd functions (`torch.distributed._functional_collectives.all_to_all_single_autograd`), so
the gradients of the rows return to their tokens' ranks, and each owner's expert gradients sum over the tokens of
its whole group; FSDP2 (each experts module a group of its own over the data-parallel dims outside `ep`:
`lathe.train.parallel.expert_mesh`) sums them over the other groups. The load-balancing loss is each rank's own
tokens', as without expert parallelism.

With Ulysses sequence parallelism (`lathe.train.ulysses`, size S) the mesh is the same: FSDP2 shards the dense
weights over every rank, the `ep` groups are P consecutive ranks as above, so they hold whole sequence-parallel
groups of S consecutive ranks when S divides P, or lie inside one when P divides S (torchtitan's EP borrows its
context-parallel ranks the same way); any other pair of sizes computes the same too. Outside attention each rank
holds its own slice of the micro-batch's packed stream, so a sparse layer dispatches the tokens of that slice (the
padding that makes the stream divisible by S included, its outputs unread): which rank holds a token does not change
what its experts compute, nor where its gradient returns. The load-balancing loss is then the whole micro-batch's,
its statistics summed over the sequence-parallel group (`lathe.train.ulysses.router_totals`), as in one process.

LoRA (`lathe.models.lora`) composes too: its adapters sit on linear layers (attention, dense MLPs, shared experts),
never on the grouped expert weights, so the experts cut here stay frozen (their DTensors keep `requires_grad=False`,
and the rows' gradients still return through the all-to-alls to the adapters before them); the reference is this
model with its adapters off, and the engine's sync sends the merged adapted layers only.

Beside tensor parallelism (size T, `lathe.train.tensor_parallel`) the size is T and the group is the tensor-parallel
group itself (`MeshPlan.experts_over_tp`; the layout of lathe's engine inside a tensor-parallel replica,
`lathe.engine.expert_parallel`; Megatron's expert_model_parallel_size equal to its tensor_model_parallel_size). The
ranks of a tensor-parallel group hold the same tokens (no sequence-parallel norms), so nothing is dispatched: every
rank runs the router (its weight whole on every rank of the group, as the norms are) and the sort on all of them, as
in one process, runs its E/T experts on their contiguous run of the sorted rows, and the group sums its partial
outputs, zero outside each rank's run (one all-reduce per sparse layer, as after a row-parallel projection; its
backward passes the output's gradient, whole and the same on every rank, through). The rows enter the experts
through the reverse (identity forward, all-reduce backward: Megatron's "copy to the tensor-parallel region"), so
the input's gradient is whole again. The router's gradient is the same on every rank of the group, each rank's
experts' its own over all the tokens; FSDP2 shards both over the data-parallel dims, as the other tensor-parallel
weights. The routers' statistics and load-balancing losses are the whole micro-batch's on every rank, counted once
(the loss is the group's common loss, not a sum over it). Whole tensors (checkpoints, the engine's sync) gather the
experts over both dims as any tensor-parallel weight (`lathe.train.parallel.full_tensors`).

A size P = m x T (m > 1: `MeshPlan.ep_over_tp_groups`; Megatron's expert_model_parallel_size above its
tensor_model_parallel_size, expert_tensor_parallel_size 1) places the experts over m consecutive tensor-parallel
groups, E/P whole experts per rank, and dispatches as without tensor parallelism, each rank of a tensor-parallel
group sending an equal contiguous share (1/T) of its group's sorted rows: the ranks of a group hold the same rows,
so between them they send each row once, and an expert's gradient sums its rows over the m groups' tokens, each
token once. The shares enter through `copy_to_group` over the tensor-parallel group (the input's gradient whole
again) and their outputs, zeros outside each rank's share, are summed over it (one all-reduce per sparse layer, as
above; an all-gather of the shares would move half the bytes, not measured yet). Router and load-balancing loss are
the tensor-parallel group's, as with P == T. FSDP2 shards each experts module over the data-parallel ranks outside
the expert-parallel group (`lathe.train.parallel.expert_mesh`).

A size P dividing T (T = r x P, r > 1: `MeshPlan.ep_within_tp_groups`; Megatron's EP below its TP) makes r
expert-parallel groups of P consecutive ranks inside each tensor-parallel group, each holding every expert once (E/P
per rank). The rows go as above: each rank of the tensor-parallel group takes its 1/T share, dispatches it within
its own expert-parallel group, and the tensor-parallel group sums the outputs. Each expert then has r copies in a
tensor-parallel group, each with the gradient of the rows its group's shares sent it: FSDP2 sums them, sharding the
experts over the data-parallel ranks and those r groups (`expert_mesh`).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lathe.models.moe import sparse_blocks
from lathe.train import parallel
from lathe.train.tensor_parallel import copy_to_group, sum_over_group


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in the expert-parallel layout of a model's mesh."""

    size: int              # P: ranks that hold the experts of every sparse layer between them
    rank: int              # this rank's place in its group: it holds experts [rank E/P, (rank+1) E/P)
    mesh: Any              # the ep dim of the world mesh (a 1-D DeviceMesh over this rank's group)
    group: Any             # its process group
    same_tokens: bool = False   # the group is a tensor-parallel group: every rank holds its tokens (module doc)
    tp: Any = None              # P = m x T or T = r x P: this rank's TensorParallel, each rank sending 1/T of its rows


def expert_parallel(plan, device: torch.device) -> ExpertParallel | None:
    """This rank's `ExpertParallel` for a model's `MeshPlan` (None without expert parallelism). Collective: every
    rank of the worker group calls it, in the same order."""
    if plan is None or plan.ep == 1:
        return None
    mesh = parallel.world_mesh(device.type, plan)["tp" if plan.experts_over_tp else "ep"]
    tp = None
    if plan.ep_over_tp_groups or plan.ep_within_tp_groups:
        from lathe.train.tensor_parallel import tensor_parallel
        tp = tensor_parallel(plan, device)
    return ExpertParallel(size=plan.ep, rank=mesh.get_local_rank(), mesh=mesh, group=mesh.get_group(),
                          same_tokens=plan.experts_over_tp, tp=tp)


def check_model(model: nn.Module, size: int, key: str) -> None:
    """Raise unless `model`'s experts can be cut over `size` ranks: lathe's mixture-of-experts layers (Qwen3-MoE,
    Qwen3.5-MoE, GPT-OSS, DeepSeek-V3, GLM-4.5), `num_experts` divisible by the size. LoRA adapters may sit beside
    them: they are on linear layers, never on the routed experts' grouped weights (`lathe.models.lora.target_names`),
    so the experts cut here stay frozen and whole per rank."""
    if size == 1:
        return
    blocks = sparse_blocks(model)
    arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
    if not blocks:
        raise ValueError(f"{key}={size}: the model ({arch}) has no mixture-of-experts layers of lathe's (Qwen3-MoE, "
                         f"Qwen3.5-MoE, GPT-OSS, DeepSeek-V3, GLM-4.5, with model.impl=lathe), so there are no "
                         f"experts to place. Fix: set {key}=1.")
    n = blocks[0].moe.num_experts
    if n % size:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"{key}={size}: each rank of an expert-parallel group holds num_experts / {size} whole "
                         f"experts, but the model has {n} experts, which {size} does not divide. Fix: set {key} to "
                         f"one of {fits} that divides the FSDP shard group.")


def parallelize(model: nn.Module, ep: ExpertParallel | None) -> nn.Module:
    """Cut the experts of `model` (checked by `check_model`) over `ep`'s group, in place: each experts module's
    weights become DTensors sharded on the expert dim (this rank's experts whole), and its call dispatches the
    rows (module doc). Call it before FSDP2 shards the model (`lathe.train.parallel.shard`). None: as it is."""
    if ep is None:
        return model
    from torch.distributed.tensor import Shard, distribute_tensor
    for block in sparse_blocks(model):
        experts = block.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            local = distribute_tensor(p.detach(), ep.mesh, [Shard(0)], src_data_rank=None)   # no copy between ranks
            experts.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))
        experts.__class__ = _dispatching(type(experts))
        experts.expert_parallel = ep
    return model


class _Dispatch:
    """The all-to-all around an experts module's run (mixed into its class by `parallelize`)."""

    expert_parallel: ExpertParallel

    @torch.compiler.disable          # host-side split sizes and collectives
    def forward(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        ep = self.expert_parallel
        total = next(iter(self._parameters.values())).shape[0]        # the DTensor's global expert count
        local = total // ep.size
        if ep.same_tokens:
            return self._group_sum(rows, experts, local)
        if ep.tp is not None:
            return self._shares_of_group(rows, experts, total, local)
        return self._exchange(rows, experts, total, local)

    def _exchange(self, rows: torch.Tensor, experts: torch.Tensor, total: int, local: int) -> torch.Tensor:
        """The rows (sorted by expert) to their experts' owners and their outputs back (module doc)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        ep = self.expert_parallel
        counts = torch.bincount(experts, minlength=total)             # rows for each expert, in expert order
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=ep.group)      # [source rank, local expert] counts
        received = received.view(ep.size, local)
        send, recv = counts.view(ep.size, local).sum(1).tolist(), received.sum(1).tolist()
        got = all_to_all_single_autograd(rows, recv, send, ep.group)
        # the received rows run source by source, each source's by expert: regroup them by expert (stable)
        ids = torch.arange(local, device=rows.device).repeat(ep.size).repeat_interleave(received.flatten())
        ids, order = ids.sort(stable=True)
        with _local_weights(self):
            ys = super().forward(got.index_select(0, order), ids)
        ys = torch.empty_like(ys).index_copy_(0, order, ys)
        return all_to_all_single_autograd(ys, send, recv, ep.group)

    def _shares_of_group(self, rows: torch.Tensor, experts: torch.Tensor, total: int, local: int) -> torch.Tensor:
        """Expert parallelism over m whole tensor-parallel groups (module doc): this rank's 1/T of its group's rows
        exchanged, the group's outputs summed."""
        tp = self.expert_parallel.tp
        n = len(rows)
        start, end = n * tp.rank // tp.size, n * (tp.rank + 1) // tp.size
        ys = self._exchange(copy_to_group(rows, tp.group)[start:end], experts[start:end], total, local)
        out = torch.cat([ys.new_zeros(start, ys.shape[-1]), ys, ys.new_zeros(n - end, ys.shape[-1])])
        return sum_over_group(out, tp.group)

    def _group_sum(self, rows: torch.Tensor, experts: torch.Tensor, local: int) -> torch.Tensor:
        """Every row's output over a tensor-parallel group that holds them all (module doc): this rank's experts'
        contiguous run computed here, zeros elsewhere, summed over the group."""
        ep = self.expert_parallel
        first = ep.rank * local
        bounds = torch.searchsorted(experts, torch.tensor([first, first + local], device=experts.device)).tolist()
        start, end = bounds
        mine = copy_to_group(rows, ep.group)[start:end]
        with _local_weights(self):
            ys = super().forward(mine, experts[start:end] - first)
        out = torch.cat([ys.new_zeros(start, ys.shape[-1]), ys, ys.new_zeros(len(rows) - end, ys.shape[-1])])
        return sum_over_group(out, ep.group)


@functools.cache
def _dispatching(cls: type) -> type:
    return type(f"ExpertParallel{cls.__name__}", (_Dispatch, cls), {})


@contextmanager
def _local_weights(module: nn.Module):
    """The module's DTensor weights swapped for this rank's experts (`to_local`, with autograd) while it runs."""
    from torch.distributed.tensor import DTensor
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
        yield
    finally:
        module._parameters.update(saved)
