"""The rules of the parallel layouts, checked by ``load_config`` with the other cross-field rules.

Ulysses sequence parallelism (`ulysses_sequence_parallel_size` of the actor, the reference and the
critic; `lathe.train.ulysses` runs it).

With size S the trainer's devices form groups of S that compute each micro-batch together, so S must divide the
devices, and a mini-batch is split over the devices / S groups (`data_parallel`) rather than over every device.
Sequence parallelism slices the packed stream of a micro-batch, so the role must run packed (verl asks the same).
The model's heads, which must divide over S too, are checked when the model loads (`lathe.train.ulysses.check_model`).

Tensor parallelism (a role's `fsdp_config.tensor_parallel_size` T; `lathe.train.tensor_parallel`) groups devices the
same way, so a mini-batch is split over devices / T groups too; its sizes are checked with the meshes
(`plan.mesh_problems`), and here what it does not combine with yet: LoRA dropout (LoRA itself composes, with Ulysses in
the same role too: the adapters are cut beside their projections). With Ulysses in the same role (verl's
Megatron scripts' tensor_model_parallel_size with context_parallel_size) the S x T devices of a block hold one share
(devices / (S x T) data-parallel groups), the T of a tensor-parallel group consecutive and the S of a sequence-
parallel group strided by T (`lathe.train.ulysses`: the all-to-all splits each rank's heads/T heads again over S), so
S x T must divide the devices; the heads (T x S must divide the query heads) are checked when the model loads, and so
are the models tensor parallelism does not cut yet (mixture-of-experts but Qwen3-MoE's, Qwen3.5-MoE's and
Qwen3-Next's, latent attention).
Expert parallelism beside it places the experts over the ranks of each tensor-parallel group, over several whole
groups, or over groups inside each (its size the tensor-parallel size, a multiple or a divisor of it; others are
refused by `check_expert_parallel`), beside Ulysses and LoRA too.

The rollout's tensor-parallel replicas (`rollout.tensor_model_parallel_size`; `lathe.engine.tensor_parallel`) span
devices of one node or whole nodes (the trainer's in the synchronous hybrid loop, the rollout pool's in fully-async
training: `lathe.workers.lockstep`), with lathe's engine and a single-turn rollout.
"""

from __future__ import annotations

from .errors import ProblemList
from .plan import (FSDP_GROUPS, Devices, critic_in_use, expert_parallel_size, is_async, sequence_parallel_size,
                   tensor_parallel_size)
from .schema import LatheConfig

ARR = "actor_rollout_ref"
KEYS = {"actor": f"{ARR}.actor.ulysses_sequence_parallel_size", "ref": f"{ARR}.ref.ulysses_sequence_parallel_size",
        "critic": "critic.ulysses_sequence_parallel_size"}


def check_sequence_parallel(cfg: LatheConfig, devices: Devices, problems: ProblemList) -> None:
    """Each role's size is >= 1 and divides the devices; a role with size > 1 runs packed (and the actor without
    the prefix grouper)."""
    roles = ["actor", "ref"] + ["critic"] * critic_in_use(cfg)
    packed = {"actor": (f"{ARR}.model.use_remove_padding", cfg.actor_rollout_ref.model.use_remove_padding),
              "ref": (f"{ARR}.model.use_remove_padding", cfg.actor_rollout_ref.model.use_remove_padding),
              "critic": ("critic.model.use_remove_padding", cfg.critic.model.use_remove_padding)}
    for role in roles:
        size, key = sequence_parallel_size(cfg, role), KEYS[role]
        if size < 1:
            problems.add(f"{key}={size} must be >= 1 (1: no sequence parallelism). Fix: set it to 1 or more.")
            continue
        if devices.count % size:
            fits = [d for d in range(1, devices.count + 1) if devices.count % d == 0]
            problems.add(f"{key}={size} does not divide the device count ({devices.why}): the devices form groups "
                         f"of {size} that compute each micro-batch together. Fix: set {key} to a divisor of "
                         f"{devices.count} ({', '.join(map(str, fits))}).")
        switch, on = packed[role]
        if size > 1 and not on:
            problems.add(f"{key}={size} splits the packed stream of each micro-batch over {size} devices, but "
                         f"{switch}=false runs it padded. Fix: set {switch}=true (or {key}=1).")
    if sequence_parallel_size(cfg, "actor") > 1 and cfg.actor_rollout_ref.actor.use_prefix_grouper:
        problems.add(f"{ARR}.actor.use_prefix_grouper=true with {KEYS['actor']}="
                     f"{sequence_parallel_size(cfg, 'actor')}: each prefix-grouped response attends to its prompt's "
                     f"tokens, which lathe does not split over devices. Fix: set use_prefix_grouper=false (or "
                     f"{KEYS['actor']}=1).")


def check_tensor_parallel(cfg: LatheConfig, devices: Devices, problems: ProblemList) -> None:
    """A role with tensor_parallel_size T > 1 and Ulysses size S > 1 has S x T dividing the devices (module doc); LoRA
    composes with T > 1, and with T x S (the adapters are cut beside their projections: `lathe.train.tensor_parallel`;
    tests/train/test_tp_ulysses_lora_mtp.py), but not its dropout."""
    roles = ["actor", "ref"] + ["critic"] * critic_in_use(cfg)
    for role in roles:
        tp, sp = tensor_parallel_size(cfg, role), sequence_parallel_size(cfg, role)
        key = f"{FSDP_GROUPS[role]}.tensor_parallel_size"
        if tp > 1 and sp > 1 and devices.count % tp == 0 and devices.count % sp == 0 and devices.count % (tp * sp):
            problems.add(f"{key}={tp} with {KEYS[role]}={sp}: a tensor-parallel group's {tp} devices and a "
                         f"sequence-parallel group's {sp} make blocks of {tp * sp} devices that hold the same data, "
                         f"which do not divide the device count ({devices.why}). Fix: choose sizes whose product "
                         f"divides {devices.count}.")
        model, own = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.ref.fsdp_config.tensor_parallel_size
        if role == "ref" and model.lora_rank > 0 and own not in (1, tp):
            problems.add(f"{key}={own} with {ARR}.model.lora_rank={model.lora_rank}: under LoRA the reference is the "
                         f"actor's model with its adapters off, cut over the actor's tensor-parallel groups "
                         f"({FSDP_GROUPS['actor']}.tensor_parallel_size={tp}). Fix: set {key}={tp} (or leave it 1).")
        if tp > 1 and role != "critic" and model.lora_rank > 0 and model.lora_dropout > 0:
            problems.add(f"{key}={tp} with {ARR}.model.lora_dropout={model.lora_dropout}: LoRA dropout with tensor "
                         f"parallelism is not implemented yet in lathe (a column-parallel projection's whole input "
                         f"would need the same dropout mask on every rank of the group). Fix: set "
                         f"{ARR}.model.lora_dropout=0 (or {key}=1).")


def check_expert_parallel(cfg: LatheConfig, problems: ProblemList) -> None:
    """A role with expert_parallel_size P > 1 beside tensor_parallel_size T > 1 has P a multiple of T: P == T places
    the experts over the ranks of each tensor-parallel group, which hold the same tokens (`lathe.train.
    expert_parallel`: no dispatch, one all-reduce per sparse layer); P = m x T over m consecutive tensor-parallel
    groups (each rank of a group dispatches 1/T of its group's rows: Megatron's EP above TP with expert tensor
    parallelism 1); P dividing T over T/P groups of P consecutive ranks inside each tensor-parallel group (the same
    shares, dispatched within each). Other sizes (neither a multiple nor a divisor) are refused. Ulysses composes, with or without tensor parallelism (each rank dispatches the
    tokens of its slice, or its share of them), and so does LoRA, whose adapters sit on the attention, dense-MLP
    and shared-expert layers while the routed experts, cut over the group, stay frozen (`lathe.models.lora`):
    tests/train/test_tp_expert_parallel.py checks TP x EP x Ulysses, x LoRA and all four. The sizes are checked
    with the meshes (`plan.mesh_problems`), the model's experts when it loads (`lathe.train.expert_parallel.
    check_model`)."""
    roles = ["actor", "ref"] + ["critic"] * critic_in_use(cfg)
    for role in roles:
        ep, key = expert_parallel_size(cfg, role), f"{FSDP_GROUPS[role]}.expert_parallel_size"
        tp_key, tp = f"{FSDP_GROUPS[role]}.tensor_parallel_size", tensor_parallel_size(cfg, role)
        if ep <= 1 or tp <= 1:
            continue
        if ep % tp and tp % ep:
            problems.add(f"{key}={ep} with {tp_key}={tp}: beside tensor parallelism lathe places the experts over "
                         f"the ranks of each tensor-parallel group, over several whole groups, or over groups of "
                         f"consecutive ranks inside each (an expert_parallel_size that is a multiple or a divisor of "
                         f"tensor_parallel_size); {ep} is neither. Fix: set {key} to a multiple or a divisor of {tp}, "
                         f"or {key}=1 (the experts whole on every rank, sharded by FSDP), or {tp_key}=1.")


def check_keep_gathered(cfg: LatheConfig, problems: ProblemList) -> None:
    """fsdp_config.keep_gathered=true (lathe.train.gathered) keeps whole weights on the device through a mini-batch:
    not with weights offloaded to the host (auto leaves it off there)."""
    arr = cfg.actor_rollout_ref
    for role, fsdp in (("actor", arr.actor.fsdp_config), ("ref", arr.ref.fsdp_config),
                       ("critic", cfg.critic.model.fsdp_config)):
        offload = "param_offload" if fsdp.param_offload else "offload_policy" if fsdp.offload_policy else None
        if fsdp.keep_gathered and offload:
            problems.add(f"{FSDP_GROUPS[role]}.keep_gathered=true with {FSDP_GROUPS[role]}.{offload}=true: the "
                         "weights kept gathered through a mini-batch would stay on the device the offload moves them "
                         "off. Fix: set keep_gathered=null (auto: off with offload) or false, or drop the offload.")


def data_parallel(cfg: LatheConfig, role: str, devices: Devices) -> Devices:
    """The shares a mini-batch of `role` ('actor' or 'critic') is split into: one per sequence- or tensor-parallel
    group."""
    sp, tp = sequence_parallel_size(cfg, role), tensor_parallel_size(cfg, role)
    size = max(1, sp) * max(1, tp)
    if size <= 1 or devices.count % size:
        return devices
    groups = devices.count // size
    keys = [f"{KEYS[role]}={sp}"] * (sp > 1) + [f"{FSDP_GROUPS[role]}.tensor_parallel_size={tp}"] * (tp > 1)
    return Devices(groups, f"{groups} data-parallel group(s) = {devices.why} / {' x '.join(keys)}")


def check_rollout_tp(cfg: LatheConfig, problems: ProblemList) -> None:
    """rollout.tensor_model_parallel_size: replicas of whole ranks of one node, or of whole nodes."""
    from .data_parallel_attention import data_parallel_verdict
    ro, t, key = cfg.actor_rollout_ref.rollout, cfg.trainer, "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp, ep = ro.tensor_model_parallel_size, ro.expert_parallel_size
    verdict = data_parallel_verdict(cfg)                   # (rollout.data_parallel_size: sizes that cannot run)
    if verdict is not None and verdict[0] == "refuse":
        problems.add(verdict[1])
    # verl's EP = TP x DP, or TP / moe_tensor_parallel_size (data_parallel_attention.py; engine_data_parallel)
    if ep not in (None, 1, tp, tp * max(1, ro.data_parallel_size)) and ep * max(1, ro.moe_tensor_parallel_size) != tp:
        problems.add(f"actor_rollout_ref.rollout.expert_parallel_size={ep}: expert-parallel generation over other "
                     f"than one tensor-parallel replica's ranks ({tp}) or one data-parallel-attention engine's "
                     f"(tensor_model_parallel_size x data_parallel_size = {tp * max(1, ro.data_parallel_size)}) is "
                     f"not implemented in lathe (verl's own config requires EP = TP x data_parallel_size; lathe issue "
                     f"43). Fix: set it to {key.rsplit('.', 1)[1]}={tp}, or 1, or set data_parallel_size so that "
                     "EP = TP x data_parallel_size and that many ranks divide the rollout devices.")
    if tp == 1:
        return
    if tp < 1:
        problems.add(f"{key}={tp} must be >= 1 (the devices of one engine replica). Fix: set it to 1 or more.")
        return
    # the replicas are blocks of consecutive ranks of the trainer's devices, or of the rollout pool's (fully async)
    pool = "rollout" if is_async(cfg) else "trainer"
    nodes, per_node = (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) if is_async(cfg) else (t.nnodes,
                                                                                             t.n_gpus_per_node)
    within_node = per_node % tp == 0
    whole_nodes = tp % per_node == 0 and (nodes * per_node) % tp == 0
    if not (within_node or whole_nodes):
        problems.add(f"{key}={tp}: an engine replica spans devices of one node (a divisor of {pool}.n_gpus_per_node="
                     f"{per_node}) or whole nodes (a multiple of it that divides the {nodes} node(s)' "
                     f"{nodes * per_node} devices of {pool}.nnodes x {pool}.n_gpus_per_node). Fix: choose such a "
                     "size.")
    if ro.name == "hf":
        problems.add(f"{key}={tp}: transformers' generate (actor_rollout_ref.rollout.name=hf) runs a whole model "
                     "per device. Fix: use lathe's engine (rollout.name=lathe, or vllm/sglang, which run it), or "
                     "set it to 1.")
