"""The critic worker for ``algorithm.adv_estimator=gae`` (verl's ``CriticWorker``): the value model built from
``critic.*``, its optimizer and schedule, and the PPO value update of `lathe.train.critic`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lathe.batch import Batch
from lathe.config import LatheConfig
from lathe.config.plan import BatchPlan, MeshPlan
from lathe.models.decoder import LatheValueModel
from lathe.models.hf import select_impl
from lathe.models.rope import cast_keeping_rope
from lathe.models.value import load_value_model
from lathe.train import expert_parallel, lora, parallel, tensor_parallel, ulysses
from lathe.train.critic import PPOCritic
from lathe.train.offload import activation_offload, offload_flags
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.precision import resolve_policy
from lathe.train.recompute import enable_recompute
from lathe.train.update import nonfinite_guard

log = logging.getLogger("lathe")


class CriticWorker:
    """The critic as a placeable unit: Batch in, Batch or metrics out (in-process now, a Ray worker later).

    Builds the value model from ``critic.model`` (``path`` falls back to the policy's), its optimizer from
    ``critic.optim`` and the schedule over ``total_steps``; ``model`` injects a ready transformers module
    instead (tests). Either is moved into lathe's ``LatheValueModel`` when ``actor_rollout_ref.model.impl``
    allows and the architecture is supported (see ``lathe.models.hf.select_impl``).

    Precision follows the actor's rule (``lathe.train.precision``): on CUDA the critic computes in
    ``critic.model.fsdp_config.mixed_precision.param_dtype`` (bf16) and ``MasterAdamW`` updates ``model_dtype``
    (fp32) masters, offloaded to CPU memory with ``param_offload`` / ``optimizer_offload``; on CPU, fp32.

    LoRA (``critic.model.lora_rank`` > 0, verl's LoRA critic: PEFT's TOKEN_CLS task): adapters of rank
    ``lora_rank`` and ``lora_alpha`` on ``target_modules`` of the decoder (`lathe.train.lora.adapt`, as the actor's),
    the ``score`` head trained whole, everything else frozen in the compute dtype; the optimizer holds the adapters
    and the head. Its checkpoint holds the adapter and head in PEFT's layout, the merged model beside it.
    """

    def __init__(self, cfg: LatheConfig, tokenizer, *, plan: BatchPlan, total_steps: int, device: torch.device,
                 model=None, mesh: MeshPlan | None = None):
        """`plan`: the critic's batch cut (`RunPlan.critic`); `mesh`: its mesh (`RunPlan.mesh('critic')`; None:
        plain FSDP) on a rank of a group."""
        critic = cfg.critic
        parallel.check_plan_world(plan, "critic")
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, torch.device(device)
        key = "critic.model.fsdp_config"
        self.policy = resolve_policy(critic.model.fsdp_config, self.device, key=key)
        if model is None:
            model = load_value_model(critic.model.path, vocab_size=len(tokenizer), seed=cfg.trainer.seed,
                                     trust_remote_code=bool(critic.model.trust_remote_code),
                                     dtype=self.policy.master_dtype, override_config=critic.model.override_config,
                                     impl=cfg.actor_rollout_ref.model.impl)
        model = select_impl(model, cfg.actor_rollout_ref.model.impl, role="critic")
        self.lora = critic.model.lora_rank > 0 and _apply_lora(model, critic.model, cfg.trainer.seed)
        tensor_parallel.check_model(model, plan.tensor_parallel_size, f"{key}.tensor_parallel_size",
                                    mesh.ep if mesh else 1)
        ulysses.check_model(model, plan.sequence_parallel_size, "critic.ulysses_sequence_parallel_size",
                            plan.tensor_parallel_size, f"{key}.tensor_parallel_size")
        expert_parallel.check_model(model, mesh.ep if mesh else 1, f"{key}.expert_parallel_size")
        tp = None
        enable_recompute(model, critic.model.enable_gradient_checkpointing, critic.model.gradient_checkpointing_layers,
                         "critic.model", lathe=isinstance(model, LatheValueModel), impl_key="actor_rollout_ref.model.impl")
        sharded = parallel.in_group()   # a rank of a data-parallel group: FSDP2 moves each rank's shards to the device
        if self.lora:                   # the frozen base in the compute dtype; the adapters and the head train
            lora.place(model, self.policy, self.device, sharded=sharded)
            self.model = model
        else:
            self.model = cast_keeping_rope(model, self.policy.master_dtype, None if sharded else self.device)
        if sharded:
            tp = tensor_parallel.tensor_parallel(mesh, self.device)
            tensor_parallel.parallelize(self.model, tp)
            expert_parallel.parallelize(self.model, expert_parallel.expert_parallel(mesh, self.device))
            parallel.shard(self.model, critic.model.fsdp_config, self.policy, self.device, mesh)
            self.optimizer = build_optimizer(self.model.parameters(), critic.optim, sharded=True, key="critic.optim",
                                             fsdp_key=key, **offload_flags(critic.model.fsdp_config, self.device,
                                                                           key=key, sharded=True))
        else:
            self.optimizer = build_optimizer(self.model.parameters(), critic.optim, policy=self.policy,
                                             key="critic.optim", fsdp_key=key,
                                             **offload_flags(critic.model.fsdp_config, self.device, key=key))
        log.info("critic: %s on %s%s", self.policy.describe(), self.device, parallel.mesh_note(mesh))
        self.scheduler = build_scheduler(self.optimizer, critic.optim, total_steps)
        self.critic = PPOCritic(self.model, self.optimizer, self.scheduler, critic,
                                mini_batch_size=plan.mini_batch_sequences_per_device,
                                max_response_length=cfg.data.max_response_length,
                                use_remove_padding=critic.model.use_remove_padding,
                                nonfinite=nonfinite_guard(cfg, "critic"),
                                sp=ulysses.sequence_parallel(plan.sequence_parallel_size,
                                                             "critic.ulysses_sequence_parallel_size",
                                                             plan.tensor_parallel_size), tp=tp,
                                offload_activations=activation_offload(critic.model.enable_activation_offload,
                                                                       self.device,
                                                                       key="critic.model.enable_activation_offload"))

    def compute_values(self, batch: Batch) -> Batch:
        """``{"values": (B, R)}`` on the CPU."""
        return self.critic.compute_values(batch.to(self.device)).to("cpu")

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.update_critic(batch.to(self.device))

    def save_checkpoint(self, path: Path) -> None:
        """Weights + tokenizer (a loadable HF directory, reusable as ``critic.model.path``) + optimizer state."""
        model = self.cfg.critic.model
        self.critic.save_checkpoint(Path(path), base_model=model.path or self.cfg.actor_rollout_ref.model.path)
        if parallel.rank() == 0:
            self.tokenizer.save_pretrained(Path(path) / "huggingface")

    def load_checkpoint(self, path: Path) -> None:
        self.critic.load_checkpoint(Path(path))


def _apply_lora(model, group, seed: int) -> bool:
    """LoRA on the value model's decoder, its `score` head trained whole (verl: PEFT's TOKEN_CLS task)."""
    if not isinstance(model, LatheValueModel):
        raise ValueError(f"critic.model.lora_rank={group.lora_rank} needs lathe's value model (Llama, Qwen2, Qwen3 "
                         f"...), but the critic runs transformers {type(model).__name__}. Fix: set "
                         "critic.model.lora_rank=0, or actor_rollout_ref.model.impl=auto (or lathe) with an "
                         "architecture lathe's decoder implements.")
    lora.adapt(model, group, key="critic.model", role="critic", seed=seed, modules_to_save=("score",))
    return True
