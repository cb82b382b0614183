"""Data parallelism inside a worker: the process group it belongs to, FSDP2 wrapping, and the few collectives
the updates need.

A worker placed by `lathe.cluster` runs as one rank of a `torch.distributed` process group (NCCL on GPUs,
gloo on CPUs). Each rank holds its shard of every weight and optimizer state (FSDP2, `fully_shard` per
decoder layer plus the root) and computes on its share of each mini-batch; gradients are *summed* across
ranks (`set_gradient_divide_factor(1)`), because every loss is already normalised by the counts of the whole
mini-batch (`global_counts`). A mini-batch's update therefore does not depend on how it was cut into ranks
and micro-batches. In one process (no group) every function here is the identity and nothing is sharded.

Hybrid sharding (HSDP, verl's `fsdp_config.fsdp_size` smaller than the world): a model's `MeshPlan`
(`lathe.config.plan`) asks for a 2-D mesh `(dp_replicate, dp_shard)`; FSDP2 shards each weight over the ranks of
a `dp_shard` group and replicates it across the `dp_replicate` groups, reduce-scattering gradients within a group
and all-reducing them across groups: a sum again, so the update is the same on any mesh.

Tensor parallelism (a `MeshPlan` with `tp` > 1): the world mesh is `(dp_replicate, dp_shard, tp)`, tp innermost;
`lathe.train.tensor_parallel` cuts the layers over the `tp` dim first, then FSDP2 shards over the data-parallel dims
(`device_mesh`). Whole tensors (`full_tensors`, `full_state`) gather both.

Expert parallelism (a `MeshPlan` with `ep` > 1): the shard dim is split into `(dp_shard_mod_ep, ep)`, ep innermost,
and flattened back into `dp_shard` for the other weights; `lathe.train.expert_parallel` cuts the experts over the
`ep` dim, and each experts module becomes an FSDP2 group of its own over the remaining data-parallel dims
(`expert_mesh`), torchtitan's layout. Beside tensor parallelism (`ep` == `tp`: `MeshPlan.experts_over_tp`) the
experts are cut over the `tp` dim instead, the shard dim not split, and FSDP2 shards them over the data-parallel
dims as every other tensor-parallel weight. With `ep` = m x `tp` (`MeshPlan.ep_over_tp_groups`) the shard dim is
split into `(dp_shard_mod_ep, ep_mod_tp)`, m innermost before `tp`; `ep` is `(ep_mod_tp, tp)` flattened (m whole
tensor-parallel groups), `dp_shard` `(dp_shard_mod_ep, ep_mod_tp)` and `dp_shard_tp` all three. With `tp` = r x
`ep` (`MeshPlan.ep_within_tp_groups`) the tp dim is split into `(tp_mod_ep, ep)` instead: `tp` is those two
flattened, `dp_shard_mod_ep` `(dp_shard, tp_mod_ep)` (the experts' FSDP2 dim: each expert's r copies in a group sum
their gradients there) and `dp_shard_tp` all three.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn


def in_group() -> bool:
    """This process is a rank of a process group (placed by `lathe.cluster`, one rank included): its models are
    sharded with FSDP2."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if in_group() else 1


def check_plan_world(plan, role: str) -> None:
    """A worker's batch plan (`lathe.config.plan.BatchPlan`) cuts each mini-batch into `plan.device_count` shares; the
    process group it runs in must have that many ranks."""
    if plan.device_count != world_size():
        raise ValueError(f"{role}: the batch plan splits each mini-batch over {plan.device_count} device(s), but this "
                         f"worker runs in a group of {world_size()} rank(s). Fix: build the worker with the run plan "
                         f"of its own group (lathe.config.run_plan(cfg, device_count={world_size()})).")


def rank() -> int:
    return dist.get_rank() if in_group() else 0


def distributed() -> bool:
    """More than one rank: collectives are needed."""
    return world_size() > 1


def all_reduce(values: list[float] | torch.Tensor, *, op: str = "sum", group=None) -> torch.Tensor:
    """`values` (float64 on the CPU) summed (or `max`ed) over the ranks (of `group`; None: all of them); unchanged
    in one process. Sums over the data use a sequence-parallel role's `data_group` (`lathe.train.ulysses`): the
    ranks of a sequence-parallel group hold the same data."""
    t = torch.as_tensor(values, dtype=torch.float64).clone()
    if not distributed():
        return t
    device = _comm_device()
    out = t.to(device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return out.cpu()


def gather_objects(obj, group=None) -> list | None:
    """`obj` of every rank (of `group`; None: all of them), in rank order, on the group's first rank; None on the
    others; `[obj]` in one process."""
    if not distributed():
        return [obj]
    first = dist.get_global_rank(group, 0) if group is not None else 0
    out = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(obj, out, dst=first, group=group)
    return out


def data_group(*layouts):
    """The process group over which sums of distinct data run: the `data_group` of the first sequence- or tensor-
    parallel layout given (their groups' ranks hold the same data), or None (every rank) when all are None."""
    return next((layout.data_group for layout in layouts if layout is not None), None)


def max_over_ranks(value: int) -> int:
    return int(all_reduce([value], op="max")[0])


def sum_metrics(values: dict[str, float], group=None) -> dict[str, float]:
    """Each metric summed over the ranks (of `group`, as `all_reduce`; the ranks report the same keys)."""
    keys = sorted(values)
    return (dict(zip(keys, all_reduce([values[k] for k in keys], group=group).tolist())) if distributed()
            else dict(values))


def global_counts(mask: torch.Tensor, group=None, rows: int | None = None) -> tuple[torch.Tensor, int]:
    """(tokens, sequences) of the whole mini-batch whose share on this rank has `response_mask` `mask` and `rows`
    sequences (default: all of mask's rows; fewer where ghost rows pad the share: `lathe.batch.GHOST`), summed over
    `group`, as `all_reduce`."""
    local = [float(mask.sum()), float(mask.shape[0] if rows is None else rows)]
    tokens, seqs = all_reduce(local, group=group).tolist()
    return torch.tensor(tokens, device=mask.device, dtype=mask.sum().dtype).clamp(min=1), int(seqs)


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's `perf/max_memory_{allocated,reserved}_gb`: this device's peaks since the last reset, the largest
    over the ranks (nothing on the CPU)."""
    from lathe.device import GIB, peak_memory
    peaks = peak_memory(device)
    if peaks is None:
        return {}
    allocated, reserved = all_reduce(list(peaks), op="max").tolist()
    return {"perf/max_memory_allocated_gb": allocated / GIB, "perf/max_memory_reserved_gb": reserved / GIB}


def _comm_device() -> torch.device:
    """Where this rank's collectives put their tensors: its accelerator, or the CPU for gloo."""
    from lathe.device import current_device
    return torch.device("cpu") if dist.get_backend() == "gloo" else current_device()


# -- FSDP2 --------------------------------------------------------------------------------------------
# lathe's models compute hidden states outside forward()
FORWARD_METHODS = ("hidden_packed", "hidden_padded", "hidden_grouped", "hidden_with")


def shard_model(model: nn.Module, *, mp_policy=None, reshard_after_forward: bool = True,
                offload: bool = False, device: torch.device | None = None, mesh=None) -> nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, heads), in place.

    `mp_policy`: FSDP2's `MixedPrecisionPolicy` (bf16 compute on fp32 shards) or None; `offload`: shards and
    optimizer state in pinned CPU memory (`CPUOffloadPolicy`). lathe's models run their decoder through
    `hidden_packed` / `hidden_padded` / `hidden_grouped` / `hidden_with` as well as `forward`; those are registered as
    forward methods so FSDP2 gathers the root's weights for them too.

    `reshard_after_forward` (verl's key) applies to the decoder layers. `mesh`: the model's
    `lathe.config.plan.MeshPlan` (plain FSDP over every rank when None; HSDP when it has replicas)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method
    kw: dict = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device is not None and device.type == "cuda")
    experts_kw = whole_kw = kw
    if device is not None or mesh is not None:   # host weights are moved to the mesh's device, shard by shard
        from lathe.device import current_device
        device_type = (device or current_device()).type
        kw["mesh"] = device_mesh(device_type, mesh)
        if mesh is not None and mesh.ep > 1 and not mesh.experts_over_tp:
            experts_kw = {**kw, "mesh": expert_mesh(device_type, mesh)}
        if mesh is not None and mesh.tp > 1:
            whole_kw = {**kw, "mesh": whole_weights_mesh(device_type, mesh)}
    for layer in decoder_layers(model):
        for module in layer.modules():       # experts cut over an expert-parallel group: a group of their own
            if getattr(module, "expert_parallel", None) is not None:
                fully_shard(module, **experts_kw)
            # whole weights of which each tensor-parallel rank takes rows (`tensor_parallel._RowsOfWhole`): sharded
            # over the tensor-parallel ranks too, gathered for the rows taken
            if getattr(module, "shard_over_tp", False) and whole_kw is not kw:
                fully_shard(module, **whole_kw)
                if module.fsdp_method:
                    register_fsdp_forward_method(module, module.fsdp_method)
                module.tp_sharded = True
        fully_shard(layer, **kw)
    # the root stays gathered after forward: its heads (lm_head, score) are also used outside forward, by the
    # chunked log-prob and the value read-out; `reshard` frees it after passes without backward
    fully_shard(model, **{**kw, "reshard_after_forward": False})
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)     # sums: the losses are normalised by the global counts
            module.set_force_sum_reduction_for_comms(True)   # a plain SUM (gloo has no pre-multiplied sum)
    return model


def shard(model: nn.Module, fsdp_cfg, policy, device: torch.device, mesh=None) -> nn.Module:
    """`shard_model` with verl's `fsdp_config` keys (`reshard_after_forward`, `param_offload`/`offload_policy`, lathe's
    `keep_gathered`: `lathe.train.gathered`), a
    `lathe.train.precision` policy (bf16 compute on fp32 shards when mixed) and the model's planned `mesh` (its
    `fsdp_size`: `RunPlan.mesh(role)`)."""
    from lathe.train import gathered
    offload = bool(fsdp_cfg.param_offload or fsdp_cfg.offload_policy)
    shard_model(model, mp_policy=policy.fsdp2_policy() if policy.mixed else None, offload=offload, device=device,
                reshard_after_forward=fsdp_cfg.reshard_after_forward, mesh=mesh)
    gathered.mark(model, fsdp_cfg.keep_gathered, device, reshard_after_forward=fsdp_cfg.reshard_after_forward,
                  offloaded=offload, tp=mesh.tp if mesh is not None else 1)
    return model


def device_mesh(device_type: str, plan=None):
    """The torch `DeviceMesh` FSDP2 shards a `MeshPlan`'s model over on `device_type`: 1-D over every data-parallel
    rank for plain FSDP (also when `plan` is None), 2-D `(dp_replicate, dp_shard)` for HSDP; with tensor parallelism,
    those dims of the world mesh (`world_mesh`). Built once per shape and reused by every model sharded on it (every
    rank must ask for the same meshes in the same order: building one is collective)."""
    mesh = world_mesh(device_type, plan)
    if plan is None or plan.tp == 1 and plan.ep == 1:
        return mesh
    return mesh["dp_replicate", "dp_shard"] if plan.hsdp else mesh["dp_shard"]


def expert_mesh(device_type: str, plan):
    """The `DeviceMesh` FSDP2 shards expert-parallel experts over: the data-parallel dims outside the `ep` dim
    (`dp_shard_mod_ep`, and `dp_replicate` for HSDP); each rank's experts are sharded over the ranks at its place in
    the other expert-parallel groups."""
    mesh = world_mesh(device_type, plan)
    return mesh["dp_replicate", "dp_shard_mod_ep"] if plan.hsdp else mesh["dp_shard_mod_ep"]


def whole_weights_mesh(device_type: str, plan):
    """The `DeviceMesh` FSDP2 shards a tensor-parallel model's whole weights over (those each rank of a group takes
    rows of: `lathe.train.tensor_parallel._RowsOfWhole`): the shard and tp dims flattened into one
    (`dp_shard_tp`), beside `dp_replicate` for HSDP."""
    mesh = world_mesh(device_type, plan)
    return mesh["dp_replicate", "dp_shard_tp"] if plan.hsdp else mesh["dp_shard_tp"]


def world_mesh(device_type: str, plan=None):
    """The whole `DeviceMesh` of a `MeshPlan`: `device_mesh`'s dims, plus the innermost `tp` dim when it has one."""
    if plan is not None and plan.world != world_size():
        raise ValueError(f"the mesh plan {plan.dp_replicate} x {plan.dp_shard} (replicas x shards) needs "
                         f"{plan.world} ranks, but this worker runs in a group of {world_size()}. Fix: build the "
                         f"worker with the run plan of its own group (lathe.config.run_plan(cfg, "
                         f"device_count={world_size()})).")
    replicas, tp, ep = (plan.dp_replicate, plan.tp, plan.ep) if plan is not None else (1, 1, 1)
    if plan is not None and plan.experts_over_tp:     # the experts over the tp dim: no ep dim of their own
        ep = 1
    if plan is not None and tp > 1 and ep > 1 and not (plan.ep_over_tp_groups or plan.ep_within_tp_groups):
        raise ValueError(f"expert_parallel_size={ep} beside tensor_parallel_size={tp}: the expert-parallel size is "
                         f"the tensor-parallel size, a multiple or a divisor of it (rules_parallel.check_expert_parallel)")
    return _mesh(device_type, replicas, world_size() // (replicas * tp), tp, ep)


def mesh_note(plan=None) -> str:
    """', <the mesh>' for a worker's log line on a rank of a group ('FSDP: 4-way shards', 'HSDP: 2 replicas x 2-way
    shards'); '' in one process."""
    if not in_group():
        return ""
    return f", {plan.describe()}" if plan is not None else f", FSDP: {world_size()}-way shards"


@functools.lru_cache(maxsize=None)
def _mesh(device_type: str, replicas: int, shards: int, tp: int = 1, ep: int = 1):
    from torch.distributed.device_mesh import init_device_mesh
    replicate = [("dp_replicate", replicas)] * (replicas > 1)
    if 1 < ep < tp:         # ep inside each tensor-parallel group: tp split into (tp / ep, ep) (module doc)
        dims = replicate + [("dp_shard", shards), ("tp_mod_ep", tp // ep), ("ep", ep)]
        flat = {"tp": ("tp_mod_ep", "ep"), "dp_shard_mod_ep": ("dp_shard", "tp_mod_ep"),
                "dp_shard_tp": ("dp_shard", "tp_mod_ep", "ep")}
    elif ep > 1:            # the other weights shard over both ep dims: one flattened dp_shard
        inner = ("ep_mod_tp", ep // tp) if tp > 1 else ("ep", ep)   # beside tp: m = ep / tp whole groups
        dims = replicate + [("dp_shard_mod_ep", shards // inner[1]), inner] + [("tp", tp)] * (tp > 1)
        flat = {"dp_shard": ("dp_shard_mod_ep", inner[0])}
        if tp > 1:
            flat |= {"ep": ("ep_mod_tp", "tp"), "dp_shard_tp": ("dp_shard_mod_ep", "ep_mod_tp", "tp")}
    else:                   # (`whole_weights_mesh`; with ep == tp, the experts' ep is tp's: `world_mesh`)
        dims = replicate + [("dp_shard", shards)] + [("tp", tp)] * (tp > 1)
        flat = {"dp_shard_tp": ("dp_shard", "tp")} if tp > 1 else {}
    mesh = init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))
    for name, parts in flat.items():
        mesh[parts]._flatten(name)
    return mesh


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a decoder (lathe's or a transformers model): the longest `ModuleList`, then a MiMo
    model's multi-token-prediction layers (`model.mtp_layers`); a vision-language model's vision blocks and
    language-model layers both."""
    from lathe.models.vl import LatheVLForConditionalGeneration
    if isinstance(model, LatheVLForConditionalGeneration):
        return [*model.model.visual.blocks, *model.model.language_model.layers]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no decoder layers (nn.ModuleList) to shard")
    mtp = list(getattr(getattr(model, "model", None), "mtp_layers", None) or ())   # MiMo: groups of their own too
    return list(max(lists, key=len)) + mtp


def reshard(model: nn.Module) -> None:
    """Free the root's gathered weights after a pass without backward (FSDP2 keeps the root unsharded after
    forward, expecting a backward)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):
        model.reshard()


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of a sharded `model`, one FSDP2 group at a time: each decoder layer
    is gathered whole in one collective (in the compute dtype: bf16 under mixed precision), its tensors yielded,
    and freed before the next; the root's (embeddings, norm, heads) last. Every rank must iterate all of it."""
    for _, own in gathered_groups(model):
        for name, p in own():                # read after unshard: the gathered tensors, not the DTensor shards
            yield name, to_local(p.detach())     # tensor-parallel: a DTensor on the tp mesh, gathered whole


def gathered_groups(model: nn.Module) -> Iterator[tuple[nn.Module, Callable[[], list[tuple[str, nn.Parameter]]]]]:
    """Each FSDP2 group of a sharded `model` gathered whole in turn (layers first, the root last), with the function
    listing its own parameters by full name (call it inside the step: the gathered tensors, in the compute dtype);
    a layer is freed when the iteration moves on, the root at the end. Every rank must iterate all of it."""
    for module, own in _groups_in_order(model):
        module.unshard()
        try:
            yield module, own
        finally:
            if module is not model:
                module.reshard()
    model.reshard()


def full_shapes(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, full shape, dtype) of what `full_tensors` yields, in its order, without gathering anything (a
    DTensor shard reports its full shape)."""
    return [(name, p.shape, p.dtype) for _, own in _groups_in_order(model) for name, p in own()]


def _groups_in_order(model: nn.Module) -> list[tuple[nn.Module, Callable[[], list[tuple[str, nn.Parameter]]]]]:
    """The FSDP2 groups of `model` (layers first, the root last), each with a function listing its own parameters
    by full name as they are registered when it is called (FSDP2 swaps shards and gathered tensors on unshard)."""
    from torch.distributed.fsdp import FSDPModule
    prefixes = {id(m): name for name, m in model.named_modules()}
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [m for m in groups if m is not model] + [model]
    nested = tuple(prefixes[id(m)] + "." for m in groups if m is not model)

    def own(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        mine = prefixes[id(module)] + "." if module is not model else ""
        inner = tuple(n for n in nested if n.startswith(mine) and n != mine)     # a nested group's: in its own
        return [(name, p) for name, p in module.named_parameters(prefix=prefixes[id(module)], remove_duplicate=False)
                if not name.startswith(inner)]
    return [(m, functools.partial(own, m)) for m in groups]


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over parameters sharded on several meshes: a tensor-parallel model's sliced
    weights are DTensors on the (data-parallel, tp) mesh, its whole ones (norms, a value head) on the data-parallel
    mesh only, and DTensors of different meshes do not combine. Each mesh's norm is reduced over its own ranks
    first (a whole weight's gradient, the same on every tp rank, counts once), then the norms are joined. One mesh
    (or none): torch's own function."""
    from torch.distributed.tensor import DTensor
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [to_local(torch.nn.utils.get_total_norm(grads, 2.0)).float() for grads in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return total


def to_local(value):
    """A plain tensor for a (replicated) DTensor result such as a clipped grad-norm."""
    from torch.distributed.tensor import DTensor
    return value.full_tensor() if isinstance(value, DTensor) else value


# -- full (unsharded) state: what checkpoints hold ------------------------------------------------------
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_state(model: nn.Module) -> dict:
    """The weights as full tensors on the CPU of rank 0 (empty elsewhere); every rank calls this."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_options())


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimizer state by parameter name, full tensors on the CPU (one process)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_options())


def save_sharded(path, model: nn.Module, optimizer) -> None:
    """Weights and optimizer state with `torch.distributed.checkpoint`: every rank writes its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=str(path))


def load_sharded(path, model: nn.Module, optimizer) -> None:
    """The inverse of `save_sharded` on any number of ranks (DCP reshards), or in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": optim}
    with warnings.catch_warnings():          # one process: DCP says it assumes so; that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not in_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    _betas_as_tuples(optimizer)


def load_full_state(model: nn.Module, optimizer, weights: dict, optim_state: dict, *, ignore_missing) -> None:
    """The inverse of `full_state` on any number of ranks (each loads its shard of the full tensors); names
    `ignore_missing` accepts (a tied `lm_head.weight`) are taken from the module as it is."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    weights = dict(weights)
    for name, partner in tied_names(model).items():
        if name not in weights and ignore_missing(name) and partner in weights:
            weights[name] = weights[partner]
    set_model_state_dict(model, weights, options=_options(strict=True))
    set_optimizer_state_dict(model, optimizer, optim_state, options=_options())
    _betas_as_tuples(optimizer)


def load_full_params(model: nn.Module, weights: dict, optimizer=None, optim_state: dict | None = None) -> None:
    """Some parameters (`weights`: full tensors by name, such as a LoRA model's adapters; the others keep theirs)
    and, given, the optimizer state by name (`full_optimizer_state`'s form) on any number of ranks, one process
    included: each rank keeps its shard of the full tensors."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    result = set_model_state_dict(model, weights, options=_options(strict=False))
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise KeyError(f"tensors {unexpected[:4]} are not parameters of the model")
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=_options())
        _betas_as_tuples(optimizer)


def _betas_as_tuples(optimizer) -> None:
    for group in optimizer.param_groups:             # the round trip turns tuples into lists
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])


def tied_names(model: nn.Module) -> dict[str, str]:
    """{name: the first name of the same parameter} for parameters registered under several names."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
