"""verl's fully-asynchronous keys (``async_training``, the top-level ``rollout`` pool) and the checkpoint engine.

A run is fully asynchronous when ``rollout.n_gpus_per_node`` > 0: the rollout then has devices of its own (the
Rollouter's pool) beside the trainer's (``trainer.nnodes x trainer.n_gpus_per_node``), and the ``async_training``
keys say how stale the samples may be and how often weights move between the pools (see
``lathe.loop.fully_async``). With 0 (the default) the rollout shares the trainer's devices, as verl's hybrid
engine does, and these keys must stay at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .coerce import spec


@dataclass
class AsyncCheckpointEngineConfig:
    """verl's ``async_training.checkpoint_engine`` (the recipe's spelling of the bucketed weight sync)."""

    enable: bool = spec(True, "Send the weights in buckets (false: one tensor per bucket).")
    overlap_broadcast_and_consume: bool = spec(False, "Overlap receiving a bucket with loading the last (verl).")
    device_buffer_size_M: int | None = spec(None, "Bucket size in MB; null = actor_rollout_ref.rollout."
                                                  "update_weights_bucket_megabytes.")
    bypass_cpu: bool = spec(False, "Keep the sync off host memory (verl).")


@dataclass
class AsyncTrainingConfig:
    """verl's ``async_training`` (fully_async_policy): staleness, sync frequency, partial rollout."""

    staleness_threshold: float = spec(0.1, "Between two weight syncs the Rollouter starts at most (1 + this) x "
                                           "trigger_parameter_sync_step x require_batches x ppo_mini_batch_size "
                                           "prompts, less the stale ones still queued; 0 = on-policy streaming.")
    trigger_parameter_sync_step: int = spec(4, "Trainer updates between two weight syncs to the rollout pool.")
    require_batches: int = spec(1, "ppo_mini_batch_size groups of prompts the trainer takes per update.")
    partial_rollout: bool = spec(True, "At a sync, interrupt unfinished responses and continue them on the new "
                                       "weights (false: wait for them to finish).")
    use_rollout_log_probs: bool = spec(True, "The engine's log-probs are the PPO 'old' log-probs.")
    compute_prox_log_prob: bool = spec(False, "Also recompute the log-probs with the trainer's weights (the "
                                              "proximal policy) and correct rollout -> proximal with "
                                              "algorithm.rollout_correction.")
    checkpoint_engine: AsyncCheckpointEngineConfig = spec(factory=AsyncCheckpointEngineConfig,
                                                          help="Weight sync buckets (verl recipe spelling).")


@dataclass
class RolloutPoolConfig:
    """verl's top-level ``rollout`` group of the fully-async (and one-step-off) recipes: the Rollouter's devices."""

    nnodes: int = spec(1, "Nodes of the rollout pool.")
    n_gpus_per_node: int = spec(0, "Devices per node of the rollout pool; 0 = no pool of its own (the rollout "
                                   "shares the trainer's devices and training is synchronous).")
    total_rollout_steps: int | None = spec(None, "Prompts the Rollouter generates in all (verl's 'samples'); null "
                                                 "= what the training steps need.")
    total_epochs: int | None = spec(None, "Epochs over the prompts; null = trainer.total_epochs.")
    test_freq: int = spec(-1, "Validate every this many weight syncs (on the rollout pool); -1 = never.")


@dataclass
class CheckpointEngineConfig:
    """verl's ``actor_rollout_ref.rollout.checkpoint_engine``: how new weights reach the rollout."""

    backend: Literal["auto", "naive", "nccl"] = spec(
        "auto", "naive = in-process copy on the trainer's own devices (colocated); nccl = bucketed broadcast from "
                "the trainer to a separate rollout pool (NCCL on GPUs, gloo on CPUs); auto = by placement.")
    engine_kwargs: dict[str, Any] = spec({}, "verl: arguments of its checkpoint-engine backend.")
    custom_backend_module: str | None = spec(None, "verl: a module registering a checkpoint-engine backend of "
                                                   "its own.")
