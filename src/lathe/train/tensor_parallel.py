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
- Qwen3.5's hybrid layers: a gated full-attention layer is cut as attention above (`q_proj`'s rows hold each head's
  query and output gate side by side, so a rank's rows are its heads' both); a gated-DeltaNet layer runs this rank's
  1/T of the key heads with their value heads (the convolution is per channel and the delta rule per head, so heads
  are independent): `in_proj_z`, `in_proj_b`, `in_proj_a` column-parallel, `out_proj` row-parallel, and
  `in_proj_qkv` and the convolution, whose rows are [all q | all k | all v] sections (three blocks a rank, which no
  DTensor placement of the group gives), are whole weights that FSDP2 shards over the data-parallel and the
  tensor-parallel ranks together (`lathe.train.parallel.shard_model`: their memory divided by every rank), each rank
  taking its rows of each section from the gathered weight (`take_rows`; its FLOPs are its own; FSDP2 sums the
  rows' gradients over the group), as `A_log`, `dt_bias` (per value head) and the gated
  norm's weight (shared by the heads) are taken through `copy_to_group`. Qwen3-Next's fused projections lay their
  rows out per key head (`in_proj_qkvz`: each head's q, k, its value heads' v and z; `in_proj_ba`: their b and a),
  so they are column-parallel as they are, each rank's rows its heads'; only the convolution stays whole there;
- Nemotron-H's layers: its attention and relu^2 MLPs are cut as above (`mixer.q_proj` ..., `mixer.up_proj`,
  `mixer.down_proj`); a Mamba2 layer runs this rank's 1/T of the groups of B and C with their heads (T must divide
  `n_groups`, so that each group of the gated norm lies on one rank): `in_proj` ([z | x | B | C | dt] rows) and the
  convolution ([x | B | C] channels, with its bias) are whole weights of which each rank takes its rows, as Qwen3.5's
  `in_proj_qkv`; dt_bias, A_log, D and the gated norm's weight (per head, per channel) enter through `copy_to_group`;
  `out_proj` is row-parallel (`_LocalMamba2`). Its MoE keeps its router and latent projections whole, its experts
  over the group, its shared expert cut as a dense MLP;
- a mixture-of-experts layer (Qwen3-MoE's, Qwen3.5-MoE's, Qwen3-Next's) keeps its router whole and places its routed
  experts over the group, E/T whole experts per rank, expert parallelism of the same size
  (`lathe.train.expert_parallel`): each rank runs its experts on the tokens routed there and the group sums their
  outputs, one all-reduce, as after the MLP; Qwen3.5-MoE's (and Qwen3-Next's) shared expert is cut as a dense MLP,
  its sigmoid gate (hidden -> 1) whole.

A vision-language model's language model (`lathe.models.vl`) is cut the same way; its vision tower stays whole on every
rank of a group, which computes it on the same images (`decoder_stack`).

Every rank of a group holds the same data (the driver gives each group one share, as to a Ulysses group) and
computes the same loss; the DTensor collectives' backwards route the gradients (a whole activation's gradient is the
same on every rank of the group), so each rank's gradients are those of its slices, and FSDP2 (applied after, over
the data-parallel dims only: `lathe.train.parallel.device_mesh`) sums them over the data-parallel ranks.

With Ulysses in the same model (size S: `lathe.train.ulysses`, torchtitan's (dp, sp, tp) layout) a block of S x T
consecutive ranks holds one share; its tensor-parallel groups are cut as above, each computing one slice of the packed
stream, and the Ulysses all-to-all runs over the S ranks at the same place of the block's groups, on each rank's H/T
local heads. The sequence-parallel layout's `data_group` (ranks S x T apart) is then the one for sums over distinct
data (`lathe.train.parallel.data_group(sp, tp)` takes it first), and FSDP2's shard dim (world / T ranks) holds the
sequence-parallel ranks, whose partial gradients it sums. A gated-DeltaNet layer's Hk/T key heads (with their value
heads) are split again over S the same way (`GatedDeltaNet.head_parallel` on the rank's heads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lathe.models.vl import is_vl
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
    """Raise unless `model` can be cut over `size` ranks: lathe's text decoder or value model (Qwen3.5, Qwen3.5-MoE and
    Qwen3-Next hybrids too: `_check_linear_attention`) whose query heads, key/value heads and intermediate sizes
    divide by the size (the vocabulary need not: its slices are torch.chunk's, the last ones shorter). Mixture-of-
    experts layers only with `experts` (the expert-parallel size) equal to the size, a multiple or a divisor of it
    above 1, Qwen3-MoE's, Qwen3.5-MoE's, Qwen3-Next's and GLM-4.5's (`lathe.train.expert_parallel` places their
    experts over the group, over several whole groups or over groups inside it; the expert-parallel size must divide
    them, `expert_parallel.check_model`)."""
    if size == 1:
        return
    from lathe.models.lora import lora_layers
    from lathe.models.moe import SparseMoeBlock
    if not is_vl(model):
        ulysses.require_text_decoder(model, size, key, "be cut over a tensor-parallel group")
    stack, c, _ = decoder_stack(model)
    _check_linear_attention(model, size, key)
    if any(m.lora_dropout for _, m in lora_layers(model)):
        raise ValueError(f"{key}={size} with LoRA dropout (actor_rollout_ref.model.lora_dropout > 0): the dropout "
                         "mask on a column-parallel projection's whole input must be the same on every rank of the "
                         f"group, which lathe does not arrange yet. Fix: set lora_dropout=0 (or {key}=1).")
    if getattr(c, "mla", None) is not None:
        raise ValueError(f"{key}={size}: the latent attention of {c.architecture} (DeepSeek-V3 family) is "
                         f"not cut over a tensor-parallel group yet. Fix: set {key}=1.")
    nemotron = getattr(c, "nemotron", None)
    if nemotron is not None:
        _check_mamba(model, size, key)
        sparse = [layer.mixer for layer in stack.layers if layer.block_type == "moe"]
    else:
        sparse = [layer.mlp for layer in stack.layers if not hasattr(layer.mlp, "gate_proj")]
    ep_key = f"{key.rpartition('.')[0]}.expert_parallel_size".lstrip(".")
    if sparse and (experts == 1 or experts % size and size % experts):
        raise ValueError(f"{key}={size} with mixture-of-experts layers ({c.architecture}): their experts "
                         f"are placed over a tensor-parallel group's ranks, over several whole groups or over groups "
                         f"inside each, by expert parallelism of the same size, a multiple or a divisor of it above 1 "
                         f"({ep_key}={experts}). Fix: set {ep_key}={size} (or a multiple or divisor), or {key}=1.")
    from lathe.models.deepseek import DeepseekMoeBlock
    from lathe.models.nemotron_h import NemotronMoeBlock
    from lathe.models.qwen3_5 import SharedExpertMoeBlock
    if any(type(mlp) not in (SparseMoeBlock, SharedExpertMoeBlock, DeepseekMoeBlock, NemotronMoeBlock)
           for mlp in sparse):
        raise ValueError(f"{key}={size} with the mixture-of-experts layers of {c.architecture}: only "
                         f"Qwen3-MoE's, Qwen3.5-MoE's, Qwen3-Next's and GLM-4.5's (a router, routed experts, shared "
                         f"experts; no attention sinks) are cut over a tensor-parallel group yet. Fix: set {key}=1 "
                         f"(and {ep_key} as without tensor parallelism).")
    sizes = {"query heads (num_attention_heads)": c.num_attention_heads,
             "key/value heads (num_key_value_heads)": c.num_key_value_heads}
    if nemotron is None or "mlp" in nemotron.block_types:
        sizes["intermediate_size"] = c.intermediate_size
    shared = getattr(getattr(c, "linear_attention", None), "shared_expert_intermediate_size", 0) or (
        nemotron.shared_expert_intermediate_size if nemotron is not None and c.moe is not None else
        c.moe.n_shared_experts * c.moe.moe_intermediate_size if c.moe is not None else 0)
    if shared:                                  # Qwen3.5-MoE's shared expert, GLM-4.5's, cut as a dense MLP
        sizes["shared_expert_intermediate_size"] = shared
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
    # a gated-DeltaNet layer's column-parallel projections: Qwen3.5's z, b, a (its qkv stays whole), or Qwen3-Next's
    # fused ones, whose rows are laid out per key head (each head's q, k, v, z; its b, a), so a cut gives whole heads
    split = {"linear_attn.in_proj_z": ColwiseParallel(), "linear_attn.in_proj_b": ColwiseParallel(),
             "linear_attn.in_proj_a": ColwiseParallel()}
    fused = {"linear_attn.in_proj_qkvz": ColwiseParallel(), "linear_attn.in_proj_ba": ColwiseParallel()}
    stack, _, embed = decoder_stack(model)
    mtp = list(getattr(stack, "mtp_layers", None) or ())         # MiMo: Qwen2 layers too; their extra norms and
    for layer in [*stack.layers, *mtp]:                           # input projection stay whole, as the norms do
        if hasattr(layer, "block_type"):                          # Nemotron-H: one mixer a layer
            _parallelize_nemotron_block(layer, tp)
            continue
        linear = hasattr(layer, "linear_attn")                    # a hybrid's gated-DeltaNet layer (module doc)
        mixer = ({**(split if layer.linear_attn.la.projections == "split" else fused),
                  "linear_attn.out_proj": RowwiseParallel()} if linear else
                 {k: v for k, v in layer_plan.items() if k.startswith("self_attn.")})
        # a sparse layer's MLP: its router whole, its experts over the group (`lathe.train.expert_parallel`), a
        # shared expert (Qwen3.5-MoE's, its sigmoid gate whole; GLM-4.5's shared_experts) cut as a dense MLP
        shared = next((f"mlp.{name}." for name in ("shared_expert", "shared_experts") if hasattr(layer.mlp, name)),
                      None)
        plan = {**mixer, **{k: v for k, v in layer_plan.items()
                            if k.startswith("mlp.") and hasattr(layer.mlp, "gate_proj")},
                **({shared + k[4:]: v for k, v in layer_plan.items() if k.startswith("mlp.")} if shared else {})}
        adapters = _take_adapters(layer, plan)
        parallelize_module(layer, tp.mesh, plan)
        _place_adapters(layer, adapters, plan, tp.mesh)
        if linear:
            _local_linear_heads(layer.linear_attn, tp)
            norms = (layer.linear_attn.norm,)
        else:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv = attn.n_heads // tp.size, attn.n_kv // tp.size     # this rank's heads
            norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        for norm in norms:
            if norm is not None:                # per head, on this rank's heads: its gradient a partial sum
                norm.__class__ = _local_heads(type(norm))
                norm.tp_group = tp.group
    root = {embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
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


def take_rows(weight: torch.Tensor, rows: list[tuple[slice, ...]], rank: int, group, *,
              sharded: bool = False) -> torch.Tensor:
    """`weight`'s rows `rows[rank]` (slices, concatenated) from a whole weight that every rank of `group` holds, each
    taking its own rows (`rows`: every rank's, covering the weight). `sharded`: FSDP2 shards the weight over the
    group's ranks too and sums their gradients (`shard_model`): backward gives this rank's rows' gradient, zeros
    elsewhere. Not sharded (the group's ranks each hold it whole, not summed over the group): backward gathers every
    rank's rows' gradients whole on each rank (one all-gather), so the whole weight's gradient is the same on every
    rank, as `copy_to_group`'s would be."""
    return _TakeRows.apply(weight, rows, rank, group, sharded)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows, rank: int, group, sharded: bool) -> torch.Tensor:
        ctx.rows, ctx.rank, ctx.group, ctx.shape, ctx.sharded = rows, rank, group, weight.shape, sharded
        return torch.cat([weight[part] for part in rows[rank]])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.new_zeros(ctx.shape)       # (zeros where no rank's rows lie: none in `parallelize`'s layouts)
        if ctx.sharded:
            pieces = {ctx.rank: grad}
        else:
            import torch.distributed._functional_collectives as funcol
            gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor     # (its older name)
            pieces = dict(enumerate(funcol.wait_tensor(gather(grad.contiguous(), 0, ctx.group)).chunk(len(ctx.rows))))
        for r, piece in pieces.items():
            parts = ctx.rows[r]
            for part, block in zip(parts, piece.split([p.stop - p.start for p in parts])):
                whole[part] = block
        return whole, None, None, None, None


class _RowsOfWhole:
    """A whole weight of a gated-DeltaNet layer (Qwen3.5's `in_proj_qkv`, the convolution's) of which each rank of
    a tensor-parallel group uses its heads' rows (`taken_weight`, `take_rows`). `shard_over_tp`: FSDP2 shards it
    over the group's ranks too (`lathe.train.parallel.shard_model`, which sets `tp_sharded`; a module whose rows are
    used outside its forward names the method that takes them, `fsdp_method`, which it registers as a forward method,
    so the weight is gathered for it and its gradient reduced after)."""

    shard_over_tp = True
    tp_sharded = False
    fsdp_method: str | None = None
    tp_rows: list[tuple[slice, slice, slice]]      # every rank's rows, by its place in the group
    tp_rank: int
    tp_group: Any
    weight: torch.Tensor

    def taken_weight(self) -> torch.Tensor:
        return take_rows(self.weight, self.tp_rows, self.tp_rank, self.tp_group, sharded=self.tp_sharded)


class _RowsLinear(_RowsOfWhole, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x enters through copy_to_group: this rank's rows give a partial sum of x's gradient, as a column-parallel
        # projection's do, whose style sums them)
        return nn.functional.linear(copy_to_group(x, self.tp_group), self.taken_weight())


class _RowsConv(_RowsOfWhole, nn.Conv1d):
    fsdp_method = "taken_weight"        # (the layer's convolution kernel reads it; the module's forward never runs)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce, wait_tensor
        return wait_tensor(all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _LocalHeadsNorm:
    """A per-head norm (Qwen3's q/k norms, a gated-DeltaNet layer's gated norm) on this rank's heads: its weight
    enters through `copy_to_group` (mixed into its class by `parallelize`)."""

    tp_group: Any

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        try:
            self._parameters["weight"] = copy_to_group(weight, self.tp_group)
            return super().forward(*args)
        finally:
            self._parameters["weight"] = weight


class _LocalFusedDeltaNet:
    """A gated-DeltaNet layer (`lathe.models.qwen3_5.GatedDeltaNet`) on this rank's key heads and their value heads
    (module doc; mixed into its class by `parallelize`, after its projections were cut): the convolution's rows of
    this rank's heads in each of its q, k and v sections (`_RowsConv`), and its value heads' `A_log`, `dt_bias`
    (`tp_values`, through `copy_to_group`), taken from whole weights. Qwen3-Next's fused projections, cut
    column-parallel, give this rank's heads as they are (`project` unchanged)."""

    tp_group: Any
    tp_values: slice
    conv1d: _RowsConv

    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.taken_weight().squeeze(1)

    def _gates(self, b: torch.Tensor, a: torch.Tensor, heads: slice = slice(None)):
        """(`heads`: of this rank's value heads, a Ulysses rank's share of them.)"""
        a_log, dt_bias = (copy_to_group(p, self.tp_group)[self.tp_values][heads] for p in (self.A_log, self.dt_bias))
        return -a_log.float().exp() * nn.functional.softplus(a.float() + dt_bias), torch.sigmoid(b)


class _LocalDeltaNet(_LocalFusedDeltaNet):
    """`_LocalFusedDeltaNet` for Qwen3.5's split projections (z, b, a cut column-parallel): `in_proj_qkv`'s rows, in
    [all q | all k | all v] sections as the convolution's, are taken as the convolution's are (`_RowsLinear`)."""

    def project(self, x: torch.Tensor):
        z = self.in_proj_z(x).unflatten(-1, (self.n_v, self.la.value_head_dim))
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


NEMOTRON_PLANS = {"full_attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("up_proj", "down_proj"),
                  "moe": ("shared_experts.up_proj", "shared_experts.down_proj"), "linear_attention": ("out_proj",)}


def _parallelize_nemotron_block(layer: nn.Module, tp: TensorParallel) -> None:
    """A Nemotron-H layer cut over `tp`'s group (module doc): its projections column-parallel (q/k/v, up), or
    row-parallel (o, down, out_proj); a Mamba2 mixer's whole weights and per-head vectors taken by rows
    (`_local_mamba`); the MoE's experts by expert parallelism, after (`lathe.train.expert_parallel`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    row = ("o_proj", "down_proj", "out_proj")
    plan = {f"mixer.{name}": RowwiseParallel() if name.endswith(row) else ColwiseParallel()
            for name in NEMOTRON_PLANS[layer.block_type]}
    adapters = _take_adapters(layer, plan)
    parallelize_module(layer, tp.mesh, plan)
    _place_adapters(layer, adapters, plan, tp.mesh)
    if layer.block_type == "full_attention":
        layer.mixer.n_heads, layer.mixer.n_kv = layer.mixer.n_heads // tp.size, layer.mixer.n_kv // tp.size
    elif layer.block_type == "linear_attention":
        _local_mamba(layer.mixer, tp)


def _local_mamba(mixer: nn.Module, tp: TensorParallel) -> None:
    """`mixer` (a Mamba2 layer) runs rank `tp.rank`'s 1/T of the groups and of the heads (module doc)."""
    from dataclasses import replace
    cfg, t = mixer.cfg, tp.size
    p, s, inner, bc = cfg.head_dim, cfg.state_size, cfg.inner, cfg.n_groups * cfg.state_size
    heads, groups = cfg.num_heads // t, cfg.n_groups // t

    def sections(r: int, start: int) -> tuple[slice, slice, slice]:      # x, B, C from row `start` on
        return (slice(start + r * heads * p, start + (r + 1) * heads * p),
                slice(start + inner + r * groups * s, start + inner + (r + 1) * groups * s),
                slice(start + inner + bc + r * groups * s, start + inner + bc + (r + 1) * groups * s))
    in_rows = [(slice(r * heads * p, (r + 1) * heads * p), *sections(r, inner),
                slice(2 * inner + 2 * bc + r * heads, 2 * inner + 2 * bc + (r + 1) * heads)) for r in range(t)]
    for module, rows, cls in ((mixer.in_proj, in_rows, _RowsLinear),
                              (mixer.conv1d, [sections(r, 0) for r in range(t)], _RowsConvWithBias)):
        module.__class__ = cls
        module.tp_rows, module.tp_rank, module.tp_group = rows, tp.rank, tp.group
    mixer.tp_heads, mixer.tp_group = slice(tp.rank * heads, (tp.rank + 1) * heads), tp.group
    mixer.norm.__class__ = _local_channels(type(mixer.norm))
    mixer.norm.tp_group, mixer.norm.tp_channels = tp.group, slice(tp.rank * heads * p, (tp.rank + 1) * heads * p)
    mixer.cfg = replace(cfg, num_heads=heads, n_groups=groups)
    mixer.__class__ = _local_mamba_class(type(mixer))


class _RowsConvWithBias(_RowsOfWhole, nn.Conv1d):
    """A Mamba2 layer's convolution: its rows' weight and bias taken together (`taken`, the method FSDP2 gathers
    them for)."""

    fsdp_method = "taken"

    def taken(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.bias is None else take_rows(self.bias, self.tp_rows, self.tp_rank, self.tp_group,
                                                        sharded=self.tp_sharded)
        return self.taken_weight(), bias


class _LocalMamba2:
    """A Mamba2 mixer (`lathe.models.nemotron_h.Mamba2Mixer`) on this rank's groups and heads (module doc; mixed
    into its class by `parallelize`): the convolution's rows (`_RowsConvWithBias`), the heads' dt_bias, A_log and D
    through `copy_to_group`."""

    tp_group: Any
    tp_heads: slice

    def conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.conv1d.taken()
        return weight.squeeze(1), bias

    def head_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(copy_to_group(p, self.tp_group)[self.tp_heads] for p in (self.dt_bias, self.A_log, self.D))


class _LocalChannelsNorm:
    """A Mamba2 layer's gated norm on this rank's channels: its weight (one per channel) enters through
    `copy_to_group`, this rank's channels taken."""

    tp_group: Any
    tp_channels: slice

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        try:
            self._parameters["weight"] = copy_to_group(weight, self.tp_group)[self.tp_channels]
            return super().forward(*args)
        finally:
            self._parameters["weight"] = weight


@functools.cache
def _local_mamba_class(cls: type) -> type:
    return type(f"TensorParallel{cls.__name__}", (_LocalMamba2, cls), {})


@functools.cache
def _local_channels(cls: type) -> type:
    return type(f"TensorParallel{cls.__name__}", (_LocalChannelsNorm, cls), {})


def _check_mamba(model, size: int, key: str) -> None:
    """Raise unless Nemotron-H's Mamba2 layers can be cut over `size` ranks: groups that `size` divides, no bias on
    in_proj (`use_bias`), no LoRA adapter on in_proj (a whole weight each rank takes rows of)."""
    _, c, _ = decoder_stack(model)
    m = c.nemotron.mamba
    if m.n_groups % size:
        ok = [t for t in range(1, m.n_groups + 1) if m.n_groups % t == 0]
        raise ValueError(f"{key}={size}: {c.architecture}'s Mamba2 layers have {m.n_groups} groups of heads "
                         f"(n_groups), which each rank of a tensor-parallel group holds 1/{size} of (each group's "
                         f"gated norm on one rank). Fix: set {key} to one of {ok}.")
    if m.proj_bias:
        raise ValueError(f"{key}={size}: {c.architecture} with use_bias=true (biases on the Mamba2 projections) is "
                         f"not cut over a tensor-parallel group yet. Fix: set {key}=1.")
    from lathe.models.lora import lora_layers
    if any(name.endswith("mixer.in_proj") for name, _ in lora_layers(model)):
        raise ValueError(f"{key}={size} with a LoRA adapter on the Mamba2 layers' in_proj "
                         f"(actor_rollout_ref.model.target_modules): under tensor parallelism each rank takes its "
                         f"rows of that whole projection, which an adapter does not follow yet. Fix: leave in_proj "
                         f"out of target_modules (out_proj is cut), or set {key}=1.")


@functools.cache
def decoder_stack(model) -> tuple[nn.Module, object, str]:
    """(the module holding the decoder layers, their config, the token embeddings' path) of lathe's text decoder or
    value model (`model.model`), or of a vision-language model's language model (`model.model.language_model`,
    whose vision tower stays whole on every rank of a group: each computes it on the same images, and its
    gradients, through the embeddings' whole gradient, are the same on all of them)."""
    if is_vl(model):
        return model.model.language_model, model.config.text, "model.language_model.embed_tokens"
    return model.model, model.config, "model.embed_tokens"


def _local_delta_net(cls: type, split: bool) -> type:
    return type(f"TensorParallel{cls.__name__}", (_LocalDeltaNet if split else _LocalFusedDeltaNet, cls), {})


def _local_linear_heads(mixer: nn.Module, tp: TensorParallel) -> None:
    """`mixer` (a gated-DeltaNet layer) runs rank `tp.rank`'s 1/T of the key heads and of the value heads."""
    la = mixer.la
    k, v = la.num_key_heads // tp.size, la.num_value_heads // tp.size
    dk, dv, whole_k = la.key_head_dim, la.value_head_dim, la.num_key_heads * la.key_head_dim
    rows = [(slice(r * k * dk, (r + 1) * k * dk), slice(whole_k + r * k * dk, whole_k + (r + 1) * k * dk),
             slice(2 * whole_k + r * v * dv, 2 * whole_k + (r + 1) * v * dv)) for r in range(tp.size)]
    split = la.projections == "split"
    for module in (mixer.conv1d, *([mixer.in_proj_qkv] if split else [])):     # whole: each rank takes its rows
        module.__class__ = _RowsConv if isinstance(module, nn.Conv1d) else _RowsLinear
        module.tp_rows, module.tp_rank, module.tp_group = rows, tp.rank, tp.group
    mixer.tp_values, mixer.tp_group = slice(tp.rank * v, (tp.rank + 1) * v), tp.group
    mixer.n_k, mixer.n_v, mixer.key_dim, mixer.value_dim = k, v, k * dk, v * dv
    mixer.__class__ = _local_delta_net(type(mixer), split)


def _check_linear_attention(model, size: int, key: str) -> None:
    """Raise unless a hybrid's gated-DeltaNet layers can be cut over `size` ranks (`parallelize`): key and value
    heads that `size` divides, no LoRA adapter on Qwen3.5's whole-weight projection."""
    _, c, _ = decoder_stack(model)
    la = getattr(c, "linear_attention", None)
    if la is None:
        return
    arch = c.architecture
    if la.num_key_heads % size or la.num_value_heads % size:
        ok = [t for t in range(1, la.num_key_heads + 1) if la.num_key_heads % t == 0 and la.num_value_heads % t == 0]
        raise ValueError(f"{key}={size}: {arch}'s linear-attention layers have {la.num_key_heads} key heads and "
                         f"{la.num_value_heads} value heads, which each rank of a tensor-parallel group holds 1/{size} "
                         f"of. Fix: set {key} to one of {ok}.")
    from lathe.models.lora import lora_layers
    if any(name.endswith("linear_attn.in_proj_qkv") for name, _ in lora_layers(model)):
        raise ValueError(f"{key}={size} with a LoRA adapter on the linear-attention layers' in_proj_qkv "
                         f"(actor_rollout_ref.model.target_modules): under tensor parallelism each rank takes its "
                         f"heads' rows of that whole projection, which an adapter does not follow yet. Fix: leave "
                         f"in_proj_qkv out of target_modules (in_proj_z, in_proj_b, in_proj_a and out_proj are cut), "
                         f"or set {key}=1.")


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
