"""The memory plan printed before training: what lives where, in GiB, and whether the update fits.

Computed from parameter counts and the precision/offload keys, before any weight reaches the GPU, so a
run that cannot fit says so (with the keys that would make it fit) in seconds rather than at the first
out-of-memory error. Activations and the allocator's slack are not modelled: the plan is a floor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from lathe.device import GIB, total_memory
from lathe.dtypes import short_name
from lathe.train.optim import optimizer_state, runs_lathe_adamw
from lathe.train.precision import resolve_policy


@dataclass
class Part:
    what: str
    nbytes: int
    on_gpu: bool
    update_only: bool = False     # exists only during the update (gradients)
    why: str = ""                 # where it lives and which key put it there
    offload_key: str = ""         # the key that would move it to CPU memory


def model_parts(role: str, prefix: str, n_params: int, fsdp_cfg, device, *, trainable: bool = True,
                weights_note: str = "", sharded: bool = False, optim_cfg=None) -> list[Part]:
    """The parts one model contributes: compute weights, master weights, gradients and optimizer state (AdamW's
    moments, in host memory with `optimizer_offload`: `MasterAdamW` on one device, `OffloadedAdamW` on FSDP2
    shards). `sharded`: FSDP2 shards over several devices, where `param_offload` / `offload_policy` is FSDP2's offload
    policy, which keeps the gradient shards in host memory too (and a frozen model's shards); on one device
    `MasterAdamW` accumulates the gradients on the device whatever is offloaded. `optim_cfg`: the role's optimizer,
    whose state is counted (`lathe.train.optim.optimizer_state`; None: AdamW's moments)."""
    policy = resolve_policy(fsdp_cfg, device, key=f"{prefix}.fsdp_config", trainable=trainable)
    size = lambda dtype: n_params * torch.empty((), dtype=dtype).element_size()   # noqa: E731
    key = f"{prefix}.fsdp_config"
    # the moments follow offloaded parameters (MasterAdamW keeps them by its host masters; FSDP2's offload policy,
    # param_offload or offload_policy on several devices, keeps each shard's optimizer state with the shard)
    params_off = next((f"{key}.{k}=true" for k in ("param_offload", "offload_policy")[:1 + sharded]
                       if getattr(fsdp_cfg, k, False)), "")
    if not trainable:
        return [Part(f"{role} weights, {short_name(policy.param_dtype)}", size(policy.param_dtype), not params_off,
                     why=params_off, offload_key=f"{key}.param_offload")]
    # FSDP2's mixed precision computes in param_dtype on the fp32 shards, cast as each layer is gathered: no
    # param_dtype copy stays (e2e_30b-a3b-12l_replicas: the engines' KV cache was this part larger than planned)
    parts = ([] if sharded and policy.mixed else
             [Part(f"{role} weights, {short_name(policy.param_dtype)}{weights_note}", size(policy.param_dtype), True)])
    what, per = optimizer_state(optim_cfg, policy.master_dtype)
    adamw = runs_lathe_adamw(optim_cfg)             # lathe's own offloads; another class only by FSDP2's policy
    params_key = f"{key}.param_offload" if adamw or sharded else ""
    if policy.mixed:
        parts.append(Part(f"{role} master weights, {short_name(policy.master_dtype)}", size(policy.master_dtype),
                          not params_off, why=params_off, offload_key=params_key))
    grads_off = params_off if sharded else ""
    parts.append(Part(f"{role} gradients, {short_name(policy.reduce_dtype)} (during the update)",
                      size(policy.reduce_dtype), not grads_off, update_only=True, why=grads_off))
    why = f"{key}.optimizer_offload=true" if fsdp_cfg.optimizer_offload else params_off
    parts.append(Part(f"{role} {what}", n_params * per, not why, why=why,
                      offload_key=f"{key}.optimizer_offload" if adamw else params_key))
    return parts


def plan(cfg, n_params: int, device: torch.device, *, need_ref: bool, critic_params: int | None,
         lathe_engine: bool, world: int = 1, colocated: bool = True, lora: tuple[int, int] | None = None,
         critic_lora: int | None = None, shards: dict[str, int] | None = None,
         engine_experts: tuple[int, int] | None = None, embeddings: tuple[int, bool] = (0, False)) -> list[Part]:
    """The parts of a run on one device: actor (+ a rollout copy unless lathe's engine runs on the actor's own
    weights in the rollout dtype), reference, critic. `lathe_engine`: the rollout is lathe's engine over lathe's
    decoder. With `world` > 1 data-parallel ranks every trained or reference part is an FSDP2 shard and the engine
    holds its own full copy: 1/world, or under hybrid sharding 1/`shards[role]` ('actor', 'ref', 'critic': the
    `dp_shard` x `tp` of the role's `MeshPlan`: tensor parallelism cuts each weight over its group before FSDP2
    shards the slices; norms and biases that stay whole are too small to count). `colocated=False`: the rollout has devices of its own (fully async).
    `lora`: (adapter parameters, parameters of the adapted layers): the base is frozen in the compute dtype, only
    the adapters have masters, gradients and moments, the reference is the base itself, and lathe's engine holds
    merged copies of the adapted layers only (on one device: it shares the rest with the frozen base; sharded, it
    holds a full copy of its own, the base and adapters being shards). `critic_lora`: the parameters a LoRA critic
    trains (its adapters and value head), counted as the actor's adapters are, beside its frozen base. The reward
    model or judge and the distillation teachers are `lathe.train.memory_models.other_model_parts` (sized from
    their config.json), which the caller adds. `engine_experts`: (routed experts' parameters, D) of an engine of D
    replicas with data-parallel attention, which spreads the experts over all their ranks
    (`lathe.engine.data_parallel`). `embeddings`: (input embedding parameters, tied to the LM head): a
    tensor-parallel replica's ranks hold them whole, and a tied model's LM head besides as a vocabulary slice
    (`lathe.engine.tensor_parallel.ShardLayout.local_items`). (A hybrid's weights that each tensor-parallel rank
    takes rows of are sharded over dp_shard x tp too: `lathe.train.parallel.whole_weights_mesh`.)"""
    from lathe.dtypes import rollout_dtype
    arr = cfg.actor_rollout_ref
    compute = resolve_policy(arr.actor.fsdp_config, device, key="actor_rollout_ref.actor.fsdp_config").param_dtype
    engine_dtype = rollout_dtype(arr.rollout.dtype, torch.device(device))
    shares = lathe_engine and engine_dtype == compute and world == 1
    note = ", shared with the rollout engine" if shares else ""
    size = lambda n, dtype: n * torch.empty((), dtype=dtype).element_size()   # noqa: E731
    ranks = lambda role: (shards or {}).get(role, world) if world > 1 else 1   # noqa: E731  (a role's FSDP2 shards)
    shard = lambda role, parts: _shard(parts, ranks(role))  # noqa: E731
    if lora is not None:
        adapters, adapted = lora
        base = Part(f"actor base weights (frozen), {short_name(compute)}", size(n_params, compute), True)
        parts = shard("actor", [base, *model_parts("actor LoRA adapters", "actor_rollout_ref.actor", adapters,
                                                   arr.actor.fsdp_config, device, optim_cfg=arr.actor.optim)])
        if colocated:
            merged = adapted if lathe_engine and engine_dtype == compute and world == 1 else n_params
            parts.append(Part(f"rollout merged weights, {short_name(engine_dtype)}", size(merged, engine_dtype), True))
    else:
        parts = shard("actor", model_parts("actor", "actor_rollout_ref.actor", n_params, arr.actor.fsdp_config,
                                           device, weights_note=note, sharded=world > 1, optim_cfg=arr.actor.optim))
        if not shares and colocated:
            parts.append(Part(f"rollout weights, {short_name(engine_dtype)}", size(n_params, engine_dtype), True))
        if need_ref:
            parts += shard("ref", model_parts("reference", "actor_rollout_ref.ref", n_params, arr.ref.fsdp_config,
                                              device, trainable=False, sharded=world > 1))
    if world > 1 and lora is None:
        parts += kept_gathered_parts("actor", "actor_rollout_ref.actor", n_params, arr.actor.fsdp_config, device)
    trained = lora[0] if lora is not None else n_params
    parts += streamed_step_parts("actor", "actor_rollout_ref.actor", trained // ranks("actor"), arr.actor.fsdp_config,
                                 device, sharded=world > 1)
    if critic_params:
        parts += shard("critic", _critic_parts(cfg, critic_params, critic_lora, device))
        parts += streamed_step_parts("critic", "critic.model", (critic_lora or critic_params) // ranks("critic"),
                                     cfg.critic.model.fsdp_config, device, sharded=world > 1)
    tp = arr.rollout.tensor_model_parallel_size if colocated else 1
    if tp > 1 or engine_experts is not None:    # a replica's rank: 1/tp of the layers and the LM head, embeddings whole
        emb, tied = embeddings
        experts, d = engine_experts or (0, 1)   # (data-parallel attention: the routed experts over D x tp ranks)
        whole = emb + (emb / tp if tied else 0)
        share = ((n_params - experts - emb) / tp + whole + experts / (d * tp)) / n_params
        what = f"1/{tp} of a replica" + (f" and 1/{d * tp} of its experts" if engine_experts is not None else "")
        parts = [replace(p, nbytes=int(p.nbytes * share), what=f"{p.what}, {what}")
                 if p.what.startswith("rollout ") else p for p in parts]
    return parts


def _critic_parts(cfg, n_params: int, lora: int | None, device) -> list[Part]:
    """The critic's weights, masters, gradients and optimizer state; with LoRA (`lora`: its trained parameters) the
    base frozen in the compute dtype beside the adapters' and head's parts, as the actor's LoRA."""
    fsdp = cfg.critic.model.fsdp_config
    if lora is None:
        return model_parts("critic", "critic.model", n_params, fsdp, device, optim_cfg=cfg.critic.optim)
    compute = resolve_policy(fsdp, device, key="critic.model.fsdp_config").param_dtype
    nbytes = n_params * torch.empty((), dtype=compute).element_size()
    return [Part(f"critic base weights (frozen), {short_name(compute)}", nbytes, True),
            *model_parts("critic LoRA adapters and value head", "critic.model", lora, fsdp, device,
                         optim_cfg=cfg.critic.optim)]


def streamed_step_parts(role: str, prefix: str, n_local: int, fsdp_cfg, device, *, sharded: bool) -> list[Part]:
    """The device buffers of a streamed optimizer step (`lathe.train.master.StreamedAdam`: two chunks of the tensors
    kept in host memory, in flight at once) during the update: `OffloadedAdamW`'s moments on FSDP2 shards
    (`optimizer_offload` alone), `MasterAdamW`'s moments and, with `param_offload`, its masters on one device. Both
    cut a tensor larger than what is left of a chunk across chunks (a 7B's embedding and LM head, 545M elements
    each, too), so the two buffers are two chunks of at most `CHUNK_NUMEL` elements whatever the largest tensor
    (the few bytes by which each piece's view is aligned in a buffer aside)."""
    from lathe.train.master import CHUNK_NUMEL
    if torch.device(device).type != "cuda":          # the offload keys act on CUDA only (`offload_flags`)
        return []
    policy = resolve_policy(fsdp_cfg, device, key=f"{prefix}.fsdp_config")
    master = torch.empty((), dtype=policy.master_dtype).element_size()
    if sharded:
        per = 2 * master if fsdp_cfg.optimizer_offload and not (fsdp_cfg.param_offload or fsdp_cfg.offload_policy) \
            else 0
    else:
        per = 2 * master * bool(fsdp_cfg.optimizer_offload or fsdp_cfg.param_offload) + master * bool(
            fsdp_cfg.param_offload)
    if not per or not n_local:
        return []
    chunk = min(CHUNK_NUMEL, n_local)
    return [Part(f"{role} streamed optimizer step's buffers (2 chunks of {chunk:,} elements)", 2 * chunk * per, True,
                 update_only=True)]


def kept_gathered_parts(role: str, prefix: str, n_params: int, fsdp_cfg, device) -> list[Part]:
    """The whole weights (compute dtype) and gradients (reduce dtype) a rank holds through a mini-batch's micro-batches
    when `fsdp_config.keep_gathered` is (or auto turns) on (`lathe.train.gathered`); none otherwise."""
    from lathe.train import gathered
    tp = fsdp_cfg.tensor_parallel_size
    device = torch.device(device)
    if not gathered.decide(fsdp_cfg.keep_gathered, n_params, total_memory(device) if device.type == "cuda" else None,
                           tp=tp, offloaded=bool(fsdp_cfg.param_offload or fsdp_cfg.offload_policy)):
        return []
    policy = resolve_policy(fsdp_cfg, device, key=f"{prefix}.fsdp_config")
    each = sum(torch.empty((), dtype=d).element_size() for d in (policy.param_dtype, policy.reduce_dtype))
    return [Part(f"{role} whole weights + gradients across micro-batches ({prefix}.fsdp_config.keep_gathered)",
                 n_params * each // tp, True, update_only=True)]


def _shard(parts: list[Part], ranks: int) -> list[Part]:
    """Each part as the 1/`ranks` FSDP2 shard a rank holds (whole when `ranks` is 1)."""
    return parts if ranks <= 1 else [replace(p, nbytes=p.nbytes // ranks, what=f"{p.what}, 1/{ranks} shard")
                                     for p in parts]


def resident_bytes(parts: list[Part]) -> int:
    """Bytes of `parts` on the GPU while the engine generates."""
    return sum(p.nbytes for p in parts if p.on_gpu and not p.update_only)


def generation_room(parts: list[Part], device: torch.device, gpu_memory_utilization: float) -> float | None:
    """Bytes the engine's KV cache may take beside `parts` while it generates (None: the device's memory is unknown,
    a CPU)."""
    total = total_memory(device)
    return max(0.0, gpu_memory_utilization * total - resident_bytes(parts)) if total else None


def format_plan(parts: list[Part], device: torch.device, gpu_memory_utilization: float, *,
                kv_seq_bytes: int = 0, seqs: int = 0, mesh_fixes: list[str] = (), host_ranks: int = 1,
                host_memory: tuple[int, int | None] | None = None) -> tuple[str, bool]:
    """(the plan as log lines, whether the run fits in the device's memory, and in the host's).

    `kv_seq_bytes`: the KV cache of one sequence of the longest length (lathe's engine; 0 = not checked), and
    `seqs` the sequences one device generates per step. Room for none of them is refused: the engine could not
    start its second step, once the optimizer's state exists (its cache is sized again at each wake-up).
    `mesh_fixes`: other layouts of the same devices that would take less memory per device (`mesh_fixes`), named
    beside the offload keys when the run does not fit. `host_memory`: (total, available) bytes of the host that
    `host_ranks` ranks share (None: not checked): pinned memory cannot be swapped, so offloaded parts beyond the
    host's memory would have the kernel kill the run mid-way; beyond what is available now, it is said."""
    total = total_memory(device)
    if not total:
        return _host_plan(parts, device), True
    resident = resident_bytes(parts)
    update = resident + sum(p.nbytes for p in parts if p.on_gpu and p.update_only)
    host = sum(p.nbytes for p in parts if not p.on_gpu)
    lines = [f"memory plan on {device} ({total / GIB:.1f} GiB):"]
    for p in parts:
        place = "GPU" if p.on_gpu else "CPU"
        lines.append(f"  {p.what:<58} {p.nbytes / GIB:7.2f} GiB  {place}{'  (' + p.why + ')' if p.why else ''}")
    kv = generation_room(parts, device, gpu_memory_utilization)
    lines.append(f"  GPU while generating: {resident / GIB:.2f} GiB + KV cache up to {kv / GIB:.2f} GiB "
                 f"(rollout.gpu_memory_utilization={gpu_memory_utilization})")
    lines.append(f"  GPU during the update: {update / GIB:.2f} GiB + activations")
    if host:
        lines.append(f"  CPU (pinned): {host / GIB:.2f} GiB" + (f" a rank, {host * host_ranks / GIB:.2f} GiB for the "
                                                                 f"{host_ranks} ranks of a node" if host_ranks > 1
                                                                 else ""))
    offload = lambda during: "; ".join([*(  # noqa: E731
        f"{p.offload_key}=true saves {p.nbytes / GIB:.1f} GiB ({p.what})"
        for p in parts if p.on_gpu and p.offload_key and (during == "update" or not p.update_only)), *mesh_fixes])
    fits = update < total
    if not fits:
        lines.append(f"  DOES NOT FIT: the update needs {update / GIB:.1f} GiB of {total / GIB:.1f} GiB before "
                     f"activations. Fix: {offload('update')}; or use a smaller model.")
    if host and host_memory is not None:
        fits = _host_fits(lines, parts, host * host_ranks, host_ranks, *host_memory) and fits
    if kv_seq_bytes and seqs:
        batch = kv_seq_bytes * seqs
        enough = min(0.95, math.ceil(100 * (resident + batch) / total / 5) * 5 / 100)
        if kv < kv_seq_bytes:
            fits = False
            lines.append(
                f"  DOES NOT FIT while generating: the weights and optimizer state resident then ({resident / GIB:.1f} "
                f"GiB) leave no KV cache within rollout.gpu_memory_utilization={gpu_memory_utilization} x "
                f"{total / GIB:.1f} GiB (one sequence needs {kv_seq_bytes / GIB:.2f} GiB). Fix: "
                f"actor_rollout_ref.rollout.gpu_memory_utilization={enough}; or {offload('generate')}.")
        elif kv < batch:
            lines.append(f"  the step's {seqs} sequences per device need {batch / GIB:.1f} GiB of KV cache at their "
                         f"longest: the engine will preempt (slower); gpu_memory_utilization={enough} avoids it")
    return "\n".join(lines), fits


HOST_SHARE = 0.9       # of the host's memory that pinned parts may take (the processes, the page cache need the rest)


def _host_fits(lines: list[str], parts: list[Part], pinned: int, ranks: int, total: int, available: int | None) -> bool:
    """Whether the pinned parts of the host's `ranks` ranks fit its memory (`format_plan`); says so in `lines`."""
    who = f"the {ranks} ranks of this node" if ranks > 1 else "this run"
    if pinned > HOST_SHARE * total:
        keys = sorted({p.why for p in parts if not p.on_gpu and p.why})
        lines.append(f"  DOES NOT FIT in host memory: {who} would pin {pinned / GIB:.1f} GiB of this machine's "
                     f"{total / GIB:.1f} GiB (pinned memory cannot be swapped: the kernel would kill the run). Fix: "
                     f"unset {' or '.join(keys) or 'the offload keys'} where the GPUs have room, spread the ranks over "
                     "more nodes, or use a machine with more memory.")
        return False
    if available is not None and pinned > available:
        lines.append(f"  host memory is short: {who} will pin {pinned / GIB:.1f} GiB, {available / GIB:.1f} GiB "
                     "are available now (other processes hold the rest)")
    return True


def host_memory() -> tuple[int, int | None] | None:
    """(total, available) bytes of this machine's memory (available: Linux's MemAvailable, else None); None where
    the total cannot be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return total, available


def pinned_rounding(numels: list[int], element_size: int) -> int:
    """The bytes torch's caching host allocator adds when it pins tensors of `numels` elements one allocation each:
    it rounds every allocation up to a power of two (`MasterAdamW`'s host masters, a storage each)."""
    return sum((1 << max(0, n * element_size - 1).bit_length()) - n * element_size for n in numels if n)


def _host_plan(parts: list[Part], device: torch.device) -> str:
    """A run on the CPU: everything is in host memory. One line for a small model (a table of 0.00 GiB says
    nothing); the table, in GiB, from 1 GiB on."""
    host = sum(p.nbytes for p in parts)
    if host < GIB:
        return (f"memory plan on {device}: {host / 2**20:.1f} MiB of host memory for weights, gradients and optimizer "
                "state (before activations)")
    lines = [f"memory plan on {device}: {host / GIB:.2f} GiB of host memory before activations:"]
    lines += [f"  {p.what:<58} {p.nbytes / GIB:7.2f} GiB" for p in parts]
    return "\n".join(lines)


def count_params(model) -> int:
    """Parameters of `model`, tied tensors once."""
    return sum(p.numel() for p in model.parameters())


def mesh_fixes(parts: list[Part], *, rollout_tp: int, world: int, per_node: int, fsdp_sizes: dict[str, int]) -> list[str]:
    """Layouts of the same devices that hold less per device: a tensor-parallel rollout replica twice as wide (the
    rollout's weights halve) while it still divides the node's devices, and plain FSDP over every device for a role
    that shards over fewer (HSDP)."""
    out = []
    rollout = sum(p.nbytes for p in parts if p.what.startswith("rollout ") and p.on_gpu)
    wider = 2 * rollout_tp
    if rollout and world % wider == 0 and per_node % wider == 0:
        out.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={wider} saves {rollout / 2 / GIB:.1f} GiB "
                   "(each rank holds half as much of the rollout's weights)")
    for key, size in fsdp_sizes.items():
        if 0 < size < world:
            out.append(f"{key}=-1 shards that model over all {world} devices instead of {size}")
    return out
