"""Tensor parallelism in training (a role's `fsdp_config.tensor_parallel_size`; verl's `megatron.
tensor_model_parallel_size`), torchtitan's way: PyTorch's DTensor plans applied to lathe's decoder from here, the
model itself knowing nothing of them.

With size T over the W ranks of a worker group, ranks gT .. gT+T-1 form tensor-parallel group g (`MeshPlan.tp`, the
innermost dim of the world mesh `(dp_replicate, dp_shard, tp)`), and the ranks at the same place of every group a
data-parallel group. Within a group (Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053):

- q/k/v, gate and up projections are column-parallel (each rank holds 1/T of the heads, 1/T of the MLP's columns),
  o and down projections row-parallel (their partial outputs all-reduced): one all-reduce after attention and one
  after the MLP per layer. Each rank's attention module is told its local head counts (`n_heads`, `n_kv`), as
  torchtitan sets them, so the decoder's `.view`s split its own heads;
- the embeddings are cut over the vocabulary (row-parallel: each rank looks up its rows, the sum joins them) and so
  is the lm_head (column-parallel; tied to the embeddings when the checkpoint ties them): its full logits are never
  formed: `lathe.train.vocab_parallel` computes log-probs and entropy from each rank's slice of the vocabulary;
- norms, RoPE and a value head stay whole on every rank of the group; the activations between layers are whole too
  (no sequence-parallel norms yet: more activation memory, the same numbers). Qwen3's per-head q/k norms see only
  this rank's heads, so their weights enter through `copy_to_group` (identity forward, the gradient summed over the
  group in backward: Megatron's "copy to the tensor-parallel region"), whole and the same on every rank again;
- a mixture-of-experts layer (Qwen3-MoE's) keeps its router whole and places its routed experts over the group,
  E/T whole experts per rank, expert parallelism of the same size (`lathe.train.expert_parallel`): each rank runs
  its experts on the tokens routed there and the group sums their outputs, one all-reduce, as after the MLP.

Every rank of a group holds the same data (the driver gives each group one share, as to a Ulysses group) and
computes the same loss; the DTensor collectives' backwards route the gradients (a whole activation's gradient is the
same on every rank of the group), so each rank's gradients are those of its slices, and FSDP2 (applied after, over
the data-parallel dims only: `lathe.train.parallel.device_mesh`) sums them over the data-parallel ranks.

With Ulysses in the same model (size S: `lathe.train.ulysses`, torchtitan's (dp, sp, tp) layout) a block of S x T
consecutive ranks holds one share; its tensor-parallel groups are cut as above, each computing one slice of the packed
stream, and the Ulysses all-to-all runs over the S ranks at the same place of the block's groups, on each rank's H/T
local heads. The sequence-parallel layout's `data_group` (ranks S x T apart) is then the one for sums over distinct
data (`lathe.train.parallel.data_group(sp, tp)` takes it first), and FSDP2's shard dim (world / T ranks) holds the
sequence-parallel ranks, whose partial gradients it sums.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lathe.train import parallel, ulysses


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel layout of a model's mesh."""

    size: int              # T: ranks that hold slices of every layer and compute each micro-batch together
    rank: int              # this rank's place in its group
    mesh: Any              # the tp dim of the world mesh (a 1-D DeviceMesh over this rank's group)
    group: Any             # its process group
    data_group: Any        # the ranks at this rank's place in every group: sums over distinct data go here


def tensor_parallel(plan, device: torch.device) -> TensorParallel | None:
    """This rank's `TensorParallel` for a model's `MeshPlan` (None without tensor parallelism). Collective: every
    rank of the worker group calls it, in the same order."""
    if plan is None or plan.tp == 1:
        return None
    mesh = parallel.world_mesh(device.type, plan)["tp"]
    groups = ulysses.consecutive_groups(plan.tp)      # the same layout: T consecutive ranks, strided data groups
    return TensorParallel(size=plan.tp, rank=mesh.get_local_rank(), mesh=mesh, group=mesh.get_group(),
                          data_group=groups.data_group)


def check_model(model, size: int, key: str, experts: int = 1) -> None:
    """Raise unless `model` can be cut over `size` ranks: lathe's text decoder or value model whose query heads,
    key/value heads and intermediate size divide by the size (the vocabulary need not: its slices are torch.chunk's,
    the last ones shorter). Mixture-of-experts layers only with `experts` (the expert-parallel size) equal to the
    size, Qwen3-MoE's (`lathe.train.expert_parallel` places their experts over the group; the size must divide
    them, `expert_parallel.check_model`)."""
    if size == 1:
        return
    from lathe.models.lora import lora_layers
    from lathe.models.moe import SparseMoeBlock
    ulysses.require_text_decoder(model, size, key, "be cut over a tensor-parallel group")
    if any(m.lora_dropout for _, m in lora_layers(model)):
        raise ValueError(f"{key}={size} with LoRA dropout (actor_rollout_ref.model.lora_dropout > 0): the dropout "
                         "mask on a column-parallel projection's whole input must be the same on every rank of the "
                         f"group, which lathe does not arrange yet. Fix: set lora_dropout=0 (or {key}=1).")
    if getattr(model.config, "mla", None) is not None:
        raise ValueError(f"{key}={size}: the latent attention of {model.config.architecture} (DeepSeek-V3 family) is "
                         f"not cut over a tensor-parallel group yet. Fix: set {key}=1.")
    sparse = [layer.mlp for layer in model.model.layers if not hasattr(layer.mlp, "gate_proj")]
    ep_key = f"{key.rpartition('.')[0]}.expert_parallel_size".lstrip(".")
    if sparse and experts != size:
        raise ValueError(f"{key}={size} with mixture-of-experts layers ({model.config.architecture}): their experts "
                         f"are placed over a tensor-parallel group's ranks by expert parallelism of the same size "
                         f"({ep_key}={experts}). Fix: set {ep_key}={size}, or {key}=1.")
    if any(type(mlp) is not SparseMoeBlock for mlp in sparse):
        raise ValueError(f"{key}={size} with the mixture-of-experts layers of {model.config.architecture}: only "
                         f"Qwen3-MoE's (a router and routed experts, no shared experts, no attention sinks) are cut "
                         f"over a tensor-parallel group yet. Fix: set {key}=1 (and {ep_key} as without tensor "
                         f"parallelism).")
    c = model.config
    sizes = {"query heads (num_attention_heads)": c.num_attention_heads,
             "key/value heads (num_key_value_heads)": c.num_key_value_heads,
             "intermediate_size": c.intermediate_size}
    bad = {name: n for name, n in sizes.items() if n % size}
    if bad:
        what = ", ".join(f"{n} {name}" for name, n in bad.items())
        fits = [t for t in range(1, c.num_key_value_heads + 1) if all(n % t == 0 for n in sizes.values())]
        raise ValueError(f"{key}={size}: each rank of a tensor-parallel group holds 1/{size} of the model's heads "
                         f"and MLP columns, but the model has {what}, which {size} does not divide "
                         f"(key/value heads are not repeated over a group yet). Fix: set {key} to one of {fits}.")


def parallelize(model: nn.Module, tp: TensorParallel | None) -> nn.Module:
    """Cut `model` (lathe's decoder or value model, checked by `check_model`) over `tp`'s group, in place: call it
    before FSDP2 shards the model (`lathe.train.parallel.shard`). None: the model as it is."""
    if tp is None:
        return model
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    layer_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                  "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                  "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                  "mlp.down_proj": RowwiseParallel()}
    mtp = list(getattr(model.model, "mtp_layers", None) or ())   # MiMo: Qwen2 layers too; their extra norms and
    for layer in [*model.model.layers, *mtp]:                     # input projection stay whole, as the norms do
        # a sparse layer's MLP: its router whole, its experts over the group (`lathe.train.expert_parallel`)
        plan = {k: v for k, v in layer_plan.items() if not k.startswith("mlp.") or hasattr(layer.mlp, "gate_proj")}
        adapters = _take_adapters(layer, plan)
        parallelize_module(layer, tp.mesh, plan)
        _place_adapters(layer, adapters, plan, tp.mesh)
        attn = layer.self_attn
        attn.n_heads, attn.n_kv = attn.n_heads // tp.size, attn.n_kv // tp.size     # this rank's heads
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None:                # per head, on this rank's heads: its gradient a partial sum
                norm.__class__ = _local_heads(type(norm))
                norm.tp_group = tp.group
    root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if hasattr(model, "lm_head"):           # its forward (full logits) gathers them; training reads its weight only
        root["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, tp.mesh, root)
    if hasattr(model, "tie_weights"):       # the embeddings and lm_head are both cut over the vocabulary (dim 0)
        model.tie_weights()
    return model


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """`x` as it is, its gradient summed over `group` in backward: a whole tensor (the same on every rank) that each
    rank uses for its own part of a computation (its heads, its experts), so that each rank's gradient is partial."""
    return _CopyToGroup.apply(x, group)


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over `group` (each rank's partial result); backward passes the gradient of the sum, whole and the
    same on every rank, through (a row-parallel projection's reduction)."""
    return _SumOverGroup.apply(x, group)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch.distributed._functional_collectives import all_reduce, wait_tensor
        return wait_tensor(all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce, wait_tensor
        return wait_tensor(all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _LocalHeadsNorm:
    """A per-head norm (Qwen3's q/k norms) on this rank's heads: its weight enters through `copy_to_group` (mixed into
    its class by `parallelize`)."""

    tp_group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        try:
            self._parameters["weight"] = copy_to_group(weight, self.tp_group)
            return super().forward(x)
        finally:
            self._parameters["weight"] = weight


@functools.cache
def _local_heads(cls: type) -> type:
    return type(f"TensorParallel{cls.__name__}", (_LocalHeadsNorm, cls), {})


def _take_adapters(layer: nn.Module, layer_plan: dict) -> dict[str, dict[str, nn.Parameter]]:
    """The LoRA adapters (`lathe.models.lora`) of the planned projections of `layer`, removed from their modules so
    that torch's styles cut only the base weight and bias (ColwiseParallel would cut every parameter by rows, the
    rank dim of ``lora_A`` too)."""
    out = {}
    for path in layer_plan:
        module = layer.get_submodule(path)
        if hasattr(module, "lora_A"):
            out[path] = {leaf: module._parameters.pop(leaf) for leaf in ("lora_A", "lora_B")}
    return out


def _place_adapters(layer: nn.Module, adapters: dict, layer_plan: dict, mesh) -> None:
    """The adapters back on their (now tensor-parallel) projections as DTensors on the tp mesh, Megatron's layout:
    beside a column-parallel base (output features cut) ``lora_A`` (r x in) stays whole and ``lora_B`` (out x r) is
    cut by rows as the base weight; beside a row-parallel base (input features cut) ``lora_A`` is cut by columns
    and ``lora_B`` stays whole. The layer's forward (``x A^T B^T``) then runs on DTensors: a column-parallel branch
    yields this rank's output columns, a row-parallel one a partial sum that DTensor reduces (its rank-r product
    first, a small all-reduce, then the sum with the base's). A whole adapter's gradient comes back replicated, the
    same on every rank of the group, so the optimizer and the gradient norm count it once (`parallel.
    clip_grad_norm_`); FSDP2 shards the DTensors further over the data-parallel ranks."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    for path, params in adapters.items():
        column = isinstance(layer_plan[path], ColwiseParallel)
        placements = {"lora_A": Replicate() if column else Shard(1), "lora_B": Shard(0) if column else Replicate()}
        module = layer.get_submodule(path)
        for leaf, param in params.items():
            module.register_parameter(leaf, nn.Parameter(distribute_tensor(param.data, mesh, [placements[leaf]]),
                                                         requires_grad=param.requires_grad))
