"""What a config implies for the run, computed here once: the devices, the batch cut, each model's device mesh,
fully async or not.

`run_plan(cfg)` is the one place these facts are derived. `load_config` checks the rules against it, and
`lathe train` passes the same `RunPlan` down to the cluster and the workers, which read their numbers from it
instead of recomputing them from the keys.

verl's batch semantics: ``data.train_batch_size`` = prompts per step; each prompt is sampled ``rollout.n`` times;
``ppo_mini_batch_size`` counts PROMPTS (x n sequences, split evenly over the devices) and
``ppo_micro_batch_size_per_gpu`` counts SEQUENCES per device per forward/backward pass. With Ulysses sequence
parallelism (a role's ``ulysses_sequence_parallel_size`` S > 1) the devices form groups of S that compute each
micro-batch together: a mini-batch is split over the devices / S data-parallel groups (``data_parallel_size``),
every device of a group holding the group's share. Tensor parallelism (a role's ``fsdp_config.tensor_parallel_size``
T > 1) groups devices the same way: the T devices of a group hold slices of every layer and compute each micro-batch
together, so a mini-batch is split over devices / T groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import ConfigError
from .schema import LatheConfig


@dataclass(frozen=True)
class Devices:
    """How many devices the trainer's batch is split over, and why (quoted in messages)."""

    count: int
    why: str


@dataclass(frozen=True)
class BatchPlan:
    """How one step's batch is cut for a PPO role (actor or critic), all in sequences unless named."""

    device_count: int
    prompts_per_step: int
    sequences_per_step: int
    mini_batch_prompts: int
    mini_batch_sequences: int
    mini_batches_per_step: int
    mini_batch_sequences_per_device: int
    micro_batch_per_device: int
    grad_accum_steps: int
    sequence_parallel_size: int = 1      # the role's ulysses_sequence_parallel_size
    tensor_parallel_size: int = 1        # the role's fsdp_config.tensor_parallel_size

    @property
    def group_size(self) -> int:
        """Consecutive devices that hold the same data and compute each micro-batch together (a sequence- or
        tensor-parallel group; 1 without either)."""
        return self.sequence_parallel_size * self.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel shares a mini-batch is cut into: the devices over the group size."""
        return max(1, self.device_count // self.group_size)


@dataclass(frozen=True)
class MeshPlan:
    """The device mesh one model is sharded on, its dims named as torchtitan's `ParallelDims` names them:
    dp_replicate x dp_shard x tp = the trainer's ranks (tp innermost: the ranks of a tensor-parallel group are
    consecutive, within a node). dp_replicate = 1 is plain FSDP over every rank; > 1 is HSDP (verl's `fsdp_config.fsdp_size` = N smaller
    than the devices): each weight is sharded over a group of dp_shard ranks and replicated over dp_replicate such
    groups, its gradients summed over all of them. tp > 1 (`fsdp_config.tensor_parallel_size`): each weight is first
    cut over the tp ranks of a group (`lathe.train.tensor_parallel`) and FSDP2 shards those slices over the data-
    parallel dims; the tp ranks of a group hold the same data (`BatchPlan.tensor_parallel_size`). ep > 1
    (`fsdp_config.expert_parallel_size`): the dp_shard dim is split into (dp_shard / ep, ep), ep innermost; each
    group of ep consecutive ranks holds every expert once, num_experts / ep whole experts per rank
    (`lathe.train.expert_parallel`), which FSDP2 shards over the other data-parallel dims only; every rank holds
    data of its own. ep == tp > 1 (`experts_over_tp`): the experts are placed over the ranks of each tensor-parallel
    group instead (they hold the same tokens: no dispatch, one all-reduce), the shard dim not split. ep = m x tp
    (m > 1, `ep_over_tp_groups`): each expert-parallel group is m consecutive tensor-parallel groups, the dp_shard
    dim split into (dp_shard / m, m) (Megatron's expert_model_parallel_size above its tensor_model_parallel_size
    with expert_tensor_parallel_size 1). tp = r x ep (r > 1, `ep_within_tp_groups`): each tensor-parallel group holds
    r expert-parallel groups of ep consecutive ranks, the tp dim split into (tp / ep, ep) (Megatron's EP below its TP,
    as verl's Qwen3-30B-A3B script sets TP 4, EP 2)."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel ranks: the world over the tensor-parallel size."""
        return self.dp_replicate * self.dp_shard

    @property
    def experts_over_tp(self) -> bool:
        """Expert parallelism over the tensor-parallel groups' own ranks (ep == tp > 1), not over data-parallel ones."""
        return self.tp > 1 and self.ep == self.tp

    @property
    def ep_over_tp_groups(self) -> int:
        """m when each expert-parallel group is m > 1 whole tensor-parallel groups (ep = m x tp, tp > 1); else 0."""
        return self.ep // self.tp if self.tp > 1 and self.ep > self.tp and self.ep % self.tp == 0 else 0

    @property
    def ep_within_tp_groups(self) -> int:
        """r when each tensor-parallel group holds r > 1 expert-parallel groups (tp = r x ep, ep > 1); else 0."""
        return self.tp // self.ep if 1 < self.ep < self.tp and self.tp % self.ep == 0 else 0

    @property
    def hsdp(self) -> bool:
        """Replicated shard groups (a 2-D mesh), not plain FSDP."""
        return self.dp_replicate > 1

    def without_tensor_parallel(self) -> MeshPlan:
        """This mesh's ranks with the tp dim folded into the shard dim: a model no tensor-parallel group cuts (a
        distillation teacher placed like the reference) sharded by FSDP2 over as many ranks as this mesh's model's
        slices are (the same memory per rank), each rank computing on data of its own."""
        return replace(self, dp_shard=self.dp_shard * self.tp, tp=1)

    def describe(self) -> str:
        tp = (f" x TP {self.tp}" + f" (EP {self.ep} over its ranks)" * self.experts_over_tp
              + f", EP {self.ep} (over {self.ep_over_tp_groups} tensor-parallel groups)" * bool(self.ep_over_tp_groups)
              + f", EP {self.ep} ({self.ep_within_tp_groups} groups in each)" * bool(self.ep_within_tp_groups)
              if self.tp > 1 else f", EP {self.ep}" if self.ep > 1 else "")
        if self.hsdp:
            return f"HSDP: {self.dp_replicate} replicas x {self.dp_shard}-way shards{tp}"
        return f"FSDP: {self.dp_shard}-way shards{tp}"


@dataclass(frozen=True)
class RunPlan:
    """The run's derived facts. `critic` is None when no critic trains; `rollout_devices` is 0 when the rollout
    shares the trainer's devices (the synchronous hybrid loop)."""

    devices: Devices
    rollout_devices: int
    actor: BatchPlan
    critic: BatchPlan | None
    needs_ref: bool
    meshes: dict[str, MeshPlan] = field(default_factory=dict)    # 'actor', 'ref', 'critic': see `mesh`
    ref_sequence_parallel_size: int = 1  # actor_rollout_ref.ref.ulysses_sequence_parallel_size (null: the actor's)
    ref_tensor_parallel_size: int = 1    # actor_rollout_ref.ref.fsdp_config.tensor_parallel_size (LoRA: actor's)
    rollout_tp: int = 1         # devices per engine replica (rollout.tensor_model_parallel_size)
    reward_devices: int = 0     # the reward model's own pool (reward_model.enable_resource_pool); 0: on the trainer's
    teacher_devices: int = 0    # the teachers' own pool (distillation.nnodes x n_gpus_per_node); 0: on the trainer's

    @property
    def rollout_replicas(self) -> int:
        """Engine replicas over the trainer's devices (the synchronous hybrid loop): each generates a share."""
        return self.world // self.rollout_tp

    @property
    def world(self) -> int:
        """The trainer's ranks."""
        return self.devices.count

    def mesh(self, role: str) -> MeshPlan:
        """The mesh `role` ('actor', 'ref' or 'critic') is sharded on; plain FSDP over every rank unless planned."""
        return self.meshes.get(role, MeshPlan(1, self.world))

    @property
    def is_async(self) -> bool:
        """Fully asynchronous training: the rollout has a device pool of its own (`rollout.n_gpus_per_node` > 0)."""
        return self.rollout_devices > 0


def trainer_devices(cfg: LatheConfig) -> int:
    """trainer.nnodes x trainer.n_gpus_per_node (on a CPU run, that many CPU workers)."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def rollout_devices(cfg: LatheConfig) -> int:
    """The rollout pool's devices, rollout.nnodes x rollout.n_gpus_per_node; 0 when the rollout is colocated."""
    return cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node if cfg.rollout.n_gpus_per_node > 0 else 0


def reward_devices(cfg: LatheConfig) -> int:
    """The reward model's own pool, reward_model.nnodes x reward_model.n_gpus_per_node with reward_model.enable and
    enable_resource_pool; 0 when the reward model (if any) is colocated with the actor."""
    rm = cfg.reward_model
    return rm.nnodes * rm.n_gpus_per_node if rm.enable and rm.enable_resource_pool else 0


def teacher_devices(cfg: LatheConfig) -> int:
    """The distillation teachers' own pool, distillation.nnodes x distillation.n_gpus_per_node when distillation is
    on and both are >= 1 (verl's defaults, nnodes=0 and 8 GPUs per node, ask for none: the teachers then share the
    trainer's devices); 0 when the teachers (if any) are colocated with the actor."""
    d = cfg.distillation
    return d.nnodes * d.n_gpus_per_node if d.enabled and d.nnodes >= 1 and d.n_gpus_per_node >= 1 else 0


def is_async(cfg: LatheConfig) -> bool:
    """Fully asynchronous: the rollout has a device pool of its own (`rollout.n_gpus_per_node` > 0)."""
    return cfg.rollout.n_gpus_per_node > 0


def trainer_mode(cfg: LatheConfig) -> str:
    """verl V1's trainer mode that runs: `trainer.v1.trainer_mode` with `trainer.use_v1`, else `sync` (verl's legacy
    trainer is synchronous and reads no trainer.v1 key)."""
    return cfg.trainer.v1.trainer_mode if cfg.trainer.use_v1 else "sync"


def is_colocate_async(cfg: LatheConfig) -> bool:
    """verl V1's colocated asynchronous trainer runs (`lathe.loop.colocate_async`)."""
    return trainer_mode(cfg) == "colocate_async"


def critic_in_use(cfg: LatheConfig) -> bool:
    """critic.enable when set, else whether the advantage estimator is GAE."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def needs_ref(cfg: LatheConfig) -> bool:
    """A reference policy is computed: the KL loss or the KL penalty in the reward reads its log-probs."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def resolve_devices(cfg: LatheConfig, device_count: int | None = None) -> Devices:
    """Explicit count, else trainer.nnodes x trainer.n_gpus_per_node (on a CPU run, that many CPU workers)."""
    if device_count is not None:
        if device_count < 1:
            raise ConfigError(f"device_count={device_count} must be >= 1. Fix: pass a positive device_count.")
        return Devices(device_count, f"device_count={device_count} given to load_config")
    t = cfg.trainer
    if t.nnodes < 1 or t.n_gpus_per_node < 1:
        raise ConfigError(f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}: both must be "
                          ">= 1 (they are the nodes and the devices per node the run trains on). Fix: set them to "
                          "positive numbers (1 and 1 for one device).")
    count = trainer_devices(cfg)
    return Devices(count, f"{count} = trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}")


def sequence_parallel_size(cfg: LatheConfig, role: str) -> int:
    """``ulysses_sequence_parallel_size`` of ``role`` ('actor', 'ref' or 'critic'); the reference's null is the
    actor's (verl's default)."""
    arr = cfg.actor_rollout_ref
    if role == "ref":
        return arr.ref.ulysses_sequence_parallel_size or arr.actor.ulysses_sequence_parallel_size
    return (arr.actor if role == "actor" else cfg.critic).ulysses_sequence_parallel_size


def tensor_parallel_size(cfg: LatheConfig, role: str) -> int:
    """``fsdp_config.tensor_parallel_size`` of ``role`` ('actor', 'ref' or 'critic'); under LoRA the reference's is
    the actor's: the reference is the actor's model with its adapters off, cut over the actor's groups (a reference
    size of its own other than 1 is refused by `rules_parallel.check_tensor_parallel`)."""
    arr = cfg.actor_rollout_ref
    if role == "ref" and arr.model.lora_rank > 0:
        role = "actor"
    return {"actor": arr.actor, "ref": arr.ref, "critic": cfg.critic.model}[role].fsdp_config.tensor_parallel_size


def expert_parallel_size(cfg: LatheConfig, role: str) -> int:
    """``fsdp_config.expert_parallel_size`` of ``role`` ('actor', 'ref' or 'critic')."""
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor, "ref": arr.ref, "critic": cfg.critic.model}[role].fsdp_config.expert_parallel_size


def batch_plan(cfg: LatheConfig, device_count: int | None = None, role: str = "actor") -> BatchPlan:
    """The batch cut of a validated config for ``role`` ('actor' or 'critic')."""
    dev = resolve_devices(cfg, device_count).count
    owner = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    n, tbs, mini = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size, owner.ppo_mini_batch_size
    sp, tp = max(1, sequence_parallel_size(cfg, role)), max(1, tensor_parallel_size(cfg, role))
    per_device = -(-mini * n // max(1, dev // (sp * tp)))       # ghost rows pad an uneven split (cluster.dispatch)
    micro = min(owner.ppo_micro_batch_size_per_gpu or per_device, per_device)     # more: one micro-batch (rules)
    return BatchPlan(dev, tbs, tbs * n, mini, mini * n, tbs // mini, per_device, micro, max(1, per_device // micro),
                     sequence_parallel_size=sp, tensor_parallel_size=tp)


# role -> its fsdp_config group (verl's key fsdp_size sets the role's mesh)
FSDP_GROUPS = {"actor": "actor_rollout_ref.actor.fsdp_config", "ref": "actor_rollout_ref.ref.fsdp_config",
               "critic": "critic.model.fsdp_config"}


def mesh_plan(fsdp_size: int, devices: Devices, key: str, tp: int = 1, ep: int = 1) -> MeshPlan:
    """verl's `fsdp_size` over the trainer's data-parallel ranks (the devices / `tp`): -1 (any negative) or at least
    those: plain FSDP over all of them; N dividing them: HSDP, ranks / N replicas of N-way shards (N = 1: whole
    replicas, as DDP). `tp` (checked by `tensor_parallel_problem`) is the innermost dim; `ep` (checked by
    `expert_parallel_problem`) splits the shard dim."""
    world = devices.count // tp
    if fsdp_size < 0 or fsdp_size >= world:
        return MeshPlan(1, world, tp, ep)
    if fsdp_size == 0 or world % fsdp_size:
        divisors = [d for d in range(1, world) if world % d == 0]
        ranks = (f"{world} data-parallel ranks ({devices.why}, / tensor_parallel_size={tp})" if tp > 1 else
                 f"{world} devices ({devices.why})")
        raise ConfigError(f"`{key}`={fsdp_size} does not divide the trainer's {ranks}: "
                          "HSDP shards each weight over groups of fsdp_size devices, replicated across devices / "
                          f"fsdp_size groups. Fix: set it to one of {divisors}, or to -1 (shard over all devices).")
    return MeshPlan(world // fsdp_size, fsdp_size, tp, ep)


def fsdp_sizes(cfg: LatheConfig) -> dict[str, int]:
    """verl's `fsdp_size` of each model the trainer shards, by role: the actor's, the reference's when one is
    computed, the critic's when one trains."""
    sizes = {"actor": cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size}
    if needs_ref(cfg):
        sizes["ref"] = cfg.actor_rollout_ref.ref.fsdp_config.fsdp_size
    if critic_in_use(cfg):
        sizes["critic"] = cfg.critic.model.fsdp_config.fsdp_size
    return sizes


def role_meshes(cfg: LatheConfig, devices: Devices) -> dict[str, MeshPlan]:
    """The mesh of each model the trainer shards (see `fsdp_sizes`, `mesh_plan`)."""
    return {role: mesh_plan(size, devices, f"{FSDP_GROUPS[role]}.fsdp_size", tensor_parallel_size(cfg, role),
                            max(1, expert_parallel_size(cfg, role))) for role, size in fsdp_sizes(cfg).items()}


def tensor_parallel_problem(cfg: LatheConfig, devices: Devices, role: str) -> str | None:
    """Why `role`'s tensor_parallel_size cannot make its mesh (None when it can): >= 1, dividing the devices, and
    within a node (dividing trainer.n_gpus_per_node when there are several nodes: a group's collectives run
    several times per layer)."""
    size, key = tensor_parallel_size(cfg, role), f"{FSDP_GROUPS[role]}.tensor_parallel_size"
    per_node = cfg.trainer.n_gpus_per_node if cfg.trainer.nnodes > 1 else devices.count
    if size < 1:
        return f"`{key}`={size} must be >= 1 (1: no tensor parallelism). Fix: set it to 1 or more."
    if devices.count % size or per_node % size:
        fits = [d for d in range(1, per_node + 1) if per_node % d == 0 and devices.count % d == 0]
        return (f"`{key}`={size} does not divide the devices of a node ({devices.why}): a tensor-parallel group is "
                f"{size} consecutive devices of one node. Fix: set it to one of {fits}.")
    return None


def expert_parallel_problem(mesh: MeshPlan, size: int, key: str) -> str | None:
    """Why an expert-parallel `size` cannot split `mesh`'s shard dim (None when it can): >= 1, and dividing the shard
    group (every rank of an expert-parallel group is also one of a shard group; the replicas repeat it). Beside
    tensor parallelism it is the tensor-parallel size (the experts placed over a tensor-parallel group's ranks), a
    multiple m of it whose m divides the shard group (m whole tensor-parallel groups) or a divisor of it (groups
    within each tensor-parallel group); another size is refused by `rules_parallel.check_expert_parallel`."""
    if size < 1:
        return f"`{key}`={size} must be >= 1 (1: no expert parallelism). Fix: set it to 1 or more."
    if mesh.tp > 1:
        if size <= mesh.tp or size % mesh.tp or mesh.dp_shard % (size // mesh.tp) == 0:
            return None
        fits = [mesh.tp * d for d in range(1, mesh.dp_shard + 1) if mesh.dp_shard % d == 0]
        return (f"`{key}`={size} over tensor-parallel groups of {mesh.tp}: an expert-parallel group is "
                f"{size // mesh.tp} consecutive tensor-parallel groups, which must divide the FSDP shard group of "
                f"{mesh.dp_shard} data-parallel rank(s) ({mesh.describe()}). Fix: set it to one of {fits} (or raise "
                f"fsdp_size).")
    if mesh.dp_shard % size:
        fits = [d for d in range(1, mesh.dp_shard + 1) if mesh.dp_shard % d == 0]
        return (f"`{key}`={size} does not divide the FSDP shard group of {mesh.dp_shard} device(s) ({mesh.describe()}"
                f"): an expert-parallel group is {size} consecutive devices of one shard group. Fix: set it to one "
                f"of {fits} (or raise fsdp_size).")
    return None


def mesh_problems(cfg: LatheConfig, devices: Devices) -> list[str]:
    """What `role_meshes` would refuse, every model's at once (for `load_config`'s list of problems)."""
    out = []
    for role, size in fsdp_sizes(cfg).items():
        problem = tensor_parallel_problem(cfg, devices, role)
        if problem is not None:
            out.append(problem)
            continue
        try:
            mesh = mesh_plan(size, devices, f"{FSDP_GROUPS[role]}.fsdp_size", tensor_parallel_size(cfg, role))
        except ConfigError as e:
            out.append(str(e))
            continue
        problem = expert_parallel_problem(mesh, expert_parallel_size(cfg, role),
                                          f"{FSDP_GROUPS[role]}.expert_parallel_size")
        if problem is not None:
            out.append(problem)
    return out


def run_plan(cfg: LatheConfig, device_count: int | None = None) -> RunPlan:
    """The run's derived facts (see `RunPlan`); `device_count` plans the batch for that many trainer devices."""
    devices = resolve_devices(cfg, device_count)
    return RunPlan(devices=devices, rollout_devices=rollout_devices(cfg),
                   actor=batch_plan(cfg, devices.count, "actor"),
                   critic=batch_plan(cfg, devices.count, "critic") if critic_in_use(cfg) else None,
                   needs_ref=needs_ref(cfg), meshes=role_meshes(cfg, devices),
                   ref_sequence_parallel_size=sequence_parallel_size(cfg, "ref"),
                   ref_tensor_parallel_size=tensor_parallel_size(cfg, "ref"),
                   rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                   reward_devices=reward_devices(cfg), teacher_devices=teacher_devices(cfg))
