"""verl's V1 trainer keys (``trainer.use_v1``, ``trainer.v1``): which trainer mode runs, and its settings.

verl's current trainer (``trainer.use_v1=true``, its default) runs in one of three modes,
``trainer.v1.trainer_mode``: ``sync`` is lathe's synchronous loop; ``colocate_async`` is ``lathe.loop.
colocate_async`` (the rollout on the trainer's devices runs ahead of the trainer and carries unfinished
responses across steps); ``separate_async`` (a standalone rollout pool) is refused, naming the fully-asynchronous
keys that run it in lathe. ``trainer.use_v1=false`` is verl's legacy trainer, synchronous too, which reads no
``trainer.v1`` key. ``lathe.config.plan.trainer_mode`` says which mode runs; ``lathe.config.support_v1`` and
``rules_v1`` judge the keys. Hydra's ``_target_`` (``hybrid_rollout._target_``) is accepted and dropped by the
loader, as everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .coerce import spec

TrainerMode = Literal["sync", "colocate_async", "separate_async"]
OffPolicyStrategy = Literal["drop", "wait"]


@dataclass
class ColocateAsyncConfig:
    """verl V1's ``trainer.v1.colocate_async``: how far the colocated rollout runs ahead of the trainer."""

    num_warmup_batches: int = spec(1, "Training batches of prompts issued ahead of the first step (>= 0): between "
                                      "two steps at most (1 + this) x data.train_batch_size prompts are issued and "
                                      "not yet trained; 0 = the synchronous loop's samples.")


@dataclass
class HybridRolloutConfig:
    """verl V1's ``separate_async.hybrid_rollout``: switching a standalone rollout pool's work to the trainer's
    devices (not read: separate_async is refused)."""

    enable_switch: bool = spec(False, "verl: let the trainer's devices take rollout work when it pays.")
    switch_threshold_ratio: float = spec(0.4, "verl: the rollout-time share above which to switch.")
    adaptive_switch_threshold: bool = spec(True, "verl: adapt that threshold to the measured switch cost.")
    switch_threshold_step_up: float = spec(0.05, "verl: how much the adaptive threshold rises per step.")
    switch_threshold_step_down: float = spec(0.03, "verl: how much the adaptive threshold falls per step.")
    switch_threshold_release_steps: int = spec(2, "verl: steps before a raised threshold is lowered again.")
    switch_cost_window_size: int = spec(3, "verl: steps over which the switch cost is averaged.")


@dataclass
class SeparateAsyncConfig:
    """verl V1's ``trainer.v1.separate_async`` (a standalone rollout pool): refused, with the fully-asynchronous
    keys that run it quoting these values (``async_training.staleness_threshold``, ``trigger_parameter_sync_step``)."""

    num_warmup_batches: int = spec(1, "verl: batches the rollout pool runs ahead (lathe: async_training."
                                      "staleness_threshold).")
    parameter_sync_step: int = spec(4, "verl: mini-batch updates per step, one weight sync each step (lathe: "
                                       "async_training.trigger_parameter_sync_step).")
    hybrid_rollout: HybridRolloutConfig = spec(factory=HybridRolloutConfig, help="verl: rollout work on the "
                                                                                  "trainer's devices.")


@dataclass
class CustomSamplerConfig:
    """verl V1's ``sampler.custom_sampler``: a ReplayBuffer subclass over verl's TransferQueue (refused)."""

    path: str | None = spec(None, "verl: Python file (or module) of the replay buffer class.")
    name: str | None = spec(None, "verl: its class name.")


@dataclass
class V1SamplerConfig:
    """verl V1's ``trainer.v1.sampler``: which issued prompts a colocate_async step may train."""

    max_off_policy_threshold: int = spec(8, "colocate_async: a group issued more than this many steps (model "
                                            "versions) before the step that would train it is too stale (> 0).")
    max_off_policy_strategy: OffPolicyStrategy = spec(
        "drop", "colocate_async: drop = a too-stale group is dropped when it finishes and another prompt issued in "
                "its place; wait = the step waits for every in-flight group of that age to finish.")
    sync_refill_failed_groups: bool = spec(False, "verl: issue failed groups' prompts again within the step "
                                                  "(lathe's rollout has no failed groups).")
    custom_sampler: CustomSamplerConfig = spec(factory=CustomSamplerConfig, help="verl: a custom replay buffer.")
    sampler_kwargs: dict[str, Any] = spec({}, "verl: arguments of the custom replay buffer.")


@dataclass
class TrainerV1Config:
    """verl V1's ``trainer.v1`` (read with trainer.use_v1=true): the trainer mode and its settings."""

    trainer_mode: TrainerMode = spec("sync", "sync = lathe's synchronous loop; colocate_async = the rollout on the "
                                             "trainer's devices runs ahead of the trainer, unfinished responses "
                                             "continuing across steps (lathe.loop.colocate_async); separate_async "
                                             "(a standalone rollout pool) is refused with the fully-asynchronous "
                                             "keys that run it.")
    sync: dict[str, Any] = spec({}, "verl: the synchronous mode's settings (it has none).")
    colocate_async: ColocateAsyncConfig = spec(factory=ColocateAsyncConfig, help="The colocated asynchronous mode.")
    separate_async: SeparateAsyncConfig = spec(factory=SeparateAsyncConfig, help="verl: the separate-pool mode "
                                                                                  "(refused).")
    sampler: V1SamplerConfig = spec(factory=V1SamplerConfig, help="Which issued prompts a step trains (staleness).")
