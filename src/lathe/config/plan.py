"""What a config implies for the run, computed here once: the devices, the batch cut, fully async or not.

`run_plan(cfg)` is the one place these facts are derived. `load_config` checks the rules against it, and
`lathe train` passes the same `RunPlan` down to the cluster and the workers, which read their numbers from it
instead of recomputing them from the keys.

verl's batch semantics: ``data.train_batch_size`` = prompts per step; each prompt is sampled ``rollout.n`` times;
``ppo_mini_batch_size`` counts PROMPTS (x n sequences, split evenly over the devices) and
``ppo_micro_batch_size_per_gpu`` counts SEQUENCES per device per forward/backward pass. With Ulysses sequence
parallelism (a role's ``ulysses_sequence_parallel_size`` S > 1) the devices form groups of S that compute each
micro-batch together: a mini-batch is split over the devices / S data-parallel groups (``data_parallel_size``),
every device of a group holding the group's share.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel shares a mini-batch is cut into: the devices over the sequence-parallel size."""
        return max(1, self.device_count // self.sequence_parallel_size)


@dataclass(frozen=True)
class RunPlan:
    """The run's derived facts. `critic` is None when no critic trains; `rollout_devices` is 0 when the rollout
    shares the trainer's devices (the synchronous hybrid loop)."""

    devices: Devices
    rollout_devices: int
    actor: BatchPlan
    critic: BatchPlan | None
    needs_ref: bool
    ref_sequence_parallel_size: int = 1  # actor_rollout_ref.ref.ulysses_sequence_parallel_size (null: the actor's)

    @property
    def world(self) -> int:
        """The trainer's ranks."""
        return self.devices.count

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


def is_async(cfg: LatheConfig) -> bool:
    """Fully asynchronous: the rollout has a device pool of its own (`rollout.n_gpus_per_node` > 0)."""
    return cfg.rollout.n_gpus_per_node > 0


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


def batch_plan(cfg: LatheConfig, device_count: int | None = None, role: str = "actor") -> BatchPlan:
    """The batch cut of a validated config for ``role`` ('actor' or 'critic')."""
    dev = resolve_devices(cfg, device_count).count
    owner = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    n, tbs, mini = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size, owner.ppo_mini_batch_size
    sp = max(1, sequence_parallel_size(cfg, role))
    per_device = mini * n // max(1, dev // sp)
    micro = owner.ppo_micro_batch_size_per_gpu or per_device
    return BatchPlan(dev, tbs, tbs * n, mini, mini * n, tbs // mini, per_device, micro, max(1, per_device // micro),
                     sequence_parallel_size=sp)


def run_plan(cfg: LatheConfig, device_count: int | None = None) -> RunPlan:
    """The run's derived facts (see `RunPlan`); `device_count` plans the batch for that many trainer devices."""
    devices = resolve_devices(cfg, device_count)
    return RunPlan(devices=devices, rollout_devices=rollout_devices(cfg),
                   actor=batch_plan(cfg, devices.count, "actor"),
                   critic=batch_plan(cfg, devices.count, "critic") if critic_in_use(cfg) else None,
                   needs_ref=needs_ref(cfg), ref_sequence_parallel_size=sequence_parallel_size(cfg, "ref"))
