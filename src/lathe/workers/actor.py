"""The actor part of a worker: the trained policy, its precision, sharding, optimizer and PPO update.

Built in two steps so that the parts beside it can copy the weights in between: `Actor(...)` resolves the
implementation (lathe's decoder or transformers), applies LoRA and gradient checkpointing, and places the weights
in their training dtype; `start_training(...)` then shards them (a rank of an FSDP2 group) and builds the optimizer,
the schedule and the PPO update. The reference and the rollout take their copies between the two, from the
weights as loaded, before any sharding.

Precision (`lathe.train.precision`, verl's `fsdp_config.{model_dtype, mixed_precision}`): on CUDA the actor
computes in bf16 on fp32 master weights kept by its optimizer (`MasterAdamW`); CPU runs train in fp32. With
`fsdp_config.fp8_training` the decoder layers' projections run their products in FP8 (`lathe.train.fp8`), swapped in
by `start_training`, so the reference and the rollout copy the weights as loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lathe.algo.distillation import DistillationParams
from lathe.batch import Batch
from lathe.config.plan import BatchPlan, MeshPlan
from lathe.models.attention import set_attention
from lathe.models.decoder import LatheCausalLM
from lathe.models.rope import cast_keeping_rope
from lathe.models.vl import is_vl
from lathe.models.hf import select_impl
from lathe.rollout.base import ROUTED
from lathe.rollout.build import architecture, runs_lathe
from lathe.train import expert_parallel, fp8, lora, parallel, tensor_parallel, ulysses
from lathe.train.actor import PPOActor
from lathe.train.logprob import batched_token_stats
from lathe.train.mtp import keep_checkpoint_mtp, mtp_training
from lathe.train.offload import activation_offload, offload_flags
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.precision import resolve_policy
from lathe.train.recompute import enable_recompute
from lathe.train.routing import LogProbRouting, check_replay_model
from lathe.train.update import NonFiniteGuard, load_policy_checkpoint, save_policy_checkpoint
from lathe.train.vl import check_vl, freeze_vision_tower

log = logging.getLogger("lathe")
FSDP_KEY = "actor_rollout_ref.actor.fsdp_config"
OPTIM_KEYS = {"key": "actor_rollout_ref.actor.optim", "fsdp_key": FSDP_KEY}     # named in the optimizer's errors


class Actor:
    """The policy being trained (`model`), from `actor_rollout_ref.{model, actor}`."""

    def __init__(self, arr, model, *, device: torch.device, seed: int, with_rollout: bool):
        """`arr`: the `actor_rollout_ref` group; `model`: the policy as loaded (lathe's decoder or a transformers
        module, any dtype and device); `with_rollout`: a rollout engine is colocated (fully async: none)."""
        self.arr, self.device = arr, device
        fp8.check_device(arr.actor.fsdp_config.fp8_training, device)
        self.model = select_impl(model, arr.model.impl, role="actor")
        if is_vl(self.model):
            check_vl(self.model, arr, rollout=with_rollout)
        self.lora = arr.model.lora_rank > 0 and self._apply_lora(seed)
        if arr.actor.use_prefix_grouper and not isinstance(self.model, LatheCausalLM):
            raise ValueError("actor_rollout_ref.actor.use_prefix_grouper=true needs lathe's text decoder (Llama, "
                             f"Qwen2, Qwen3, Qwen3.5, GPT-OSS ...), but the actor runs {architecture(self.model)}. "
                             "Fix: set use_prefix_grouper=false (or model.impl=lathe for those architectures).")
        if arr.actor.router_replay.mode != "disabled":
            check_replay_model(self.model, arr.actor.router_replay.mode)
        self.mtp = mtp_training(arr.model.mtp, self.model, f"{architecture(self.model)} ({arr.model.path})")
        keep_checkpoint_mtp(arr.model.mtp, self.model, arr.model.path)
        enable_recompute(self.model, arr.model.enable_gradient_checkpointing, arr.model.gradient_checkpointing_layers,
                         "actor_rollout_ref.model", lathe=runs_lathe(self.model), impl_key="actor_rollout_ref.model.impl")
        self.policy = resolve_policy(arr.actor.fsdp_config, device, key=FSDP_KEY)
        set_attention(self.model, arr.model.override_config.get("attn_implementation"), device,
                      self.policy.param_dtype)
        self.sharded = parallel.in_group()             # a rank of a data-parallel group: FSDP2
        # sharded: the weights stay in host memory until fully_shard moves each layer's shard to the device
        if self.lora:            # the frozen base computes in param_dtype (bf16 on a GPU); only the adapters train
            lora.place(self.model, self.policy, device, sharded=self.sharded)
        else:
            cast_keeping_rope(self.model, self.policy.master_dtype, None if self.sharded else device)
        if arr.actor.freeze_vision_tower:
            freeze_vision_tower(self.model, self.policy.param_dtype, sharded=self.sharded)
        self.optimizer = self.scheduler = self.ppo = self.sp = self.tp = None

    def start_training(self, *, plan: BatchPlan, total_steps: int, temperature: float, max_response_length: int,
                       rollout_correction: dict, nonfinite: NonFiniteGuard, mesh: MeshPlan | None = None,
                       distillation: DistillationParams | None = None) -> None:
        """Shard (a rank of a group) on `mesh` (`RunPlan.mesh('actor')`; None: plain FSDP), then the optimizer (fp32
        shards; LoRA: the adapters only), its schedule and the PPO update over this rank's share of each mini-batch
        (`plan`); `distillation`: the distillation loss joins the actor's (`lathe.algo.distillation`)."""
        actor = self.arr.actor
        parallel.check_plan_world(plan, "actor")
        key, tp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size", f"{FSDP_KEY}.tensor_parallel_size"
        tensor_parallel.check_model(self.model, plan.tensor_parallel_size, tp_key, mesh.ep if mesh else 1)
        ulysses.check_model(self.model, plan.sequence_parallel_size, key, plan.tensor_parallel_size, tp_key)
        self.sp = ulysses.sequence_parallel(plan.sequence_parallel_size, key, plan.tensor_parallel_size)
        expert_parallel.check_model(self.model, mesh.ep if mesh else 1, f"{FSDP_KEY}.expert_parallel_size")
        # after the reference and the rollout took their copies, before sharding, compiling and the optimizer
        fp8.convert(self.model, actor.fsdp_config.fp8_training)
        if self.sharded:
            self.tp = tensor_parallel.tensor_parallel(mesh, self.device)
            tensor_parallel.parallelize(self.model, self.tp)
            expert_parallel.parallelize(self.model, expert_parallel.expert_parallel(mesh, self.device))
            parallel.shard(self.model, actor.fsdp_config, self.policy, self.device, mesh)
            self.optimizer = build_optimizer(self.model.parameters(), actor.optim, sharded=True, **OPTIM_KEYS,
                                             **offload_flags(actor.fsdp_config, self.device, key=FSDP_KEY,
                                                             sharded=True))
        else:
            self.optimizer = build_optimizer(self.model.parameters(), actor.optim, policy=self.policy, **OPTIM_KEYS,
                                             **offload_flags(actor.fsdp_config, self.device, key=FSDP_KEY))
        self.scheduler = build_scheduler(self.optimizer, actor.optim, total_steps)
        log.info("actor: %s on %s%s", self.policy.describe(), self.device, parallel.mesh_note(mesh))
        self.ppo = PPOActor(self.model, self.optimizer, self.scheduler, actor,
                            mini_batch_size=plan.mini_batch_sequences_per_device, temperature=temperature,
                            max_response_length=max_response_length, rollout_correction=rollout_correction,
                            use_remove_padding=self.arr.model.use_remove_padding, nonfinite=nonfinite, sp=self.sp,
                            tp=self.tp, distillation=distillation, offload_activations=activation_offload(
                                self.arr.model.enable_activation_offload, self.device,
                                key="actor_rollout_ref.model.enable_activation_offload"), mtp=self.mtp)

    def _apply_lora(self, seed: int) -> bool:
        """Adapters on the targeted layers (`lathe.models.lora`), from `lora_adapter_path` when given."""
        if not runs_lathe(self.model):
            raise ValueError("actor_rollout_ref.model.lora_rank > 0 needs lathe's own model (the architectures of "
                             "lathe.models.SUPPORTED_ARCHITECTURES and the VL ones), but the actor runs transformers "
                             f"{architecture(self.model)} (the fallback). Fix: set lora_rank=0, or use an architecture "
                             "lathe's decoder implements.")
        lora.adapt(self.model, self.arr.model, key="actor_rollout_ref.model", role="actor", seed=seed)
        return True

    # -- what the worker calls ------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch, *, micro_batch_size: int, temperature: float, **budget) -> Batch:
        """The current policy's log-probs of the responses (`old_log_probs`) and their entropy; with
        `actor.calculate_sum_pi_squared`, also each token's sum over the vocabulary of pi^2 (`sum_pi_squared`).
        Routing replay (`actor.router_replay.mode`, `lathe.train.routing`): R3 replays the rollout's routing; R2
        records this pass's as `routed_experts`."""
        sum_sq_wanted = self.arr.actor.calculate_sum_pi_squared
        mode = self.arr.actor.router_replay.mode
        routing = (LogProbRouting(mode, self.model, self.arr.model.use_remove_padding, self.sp,
                                  self.arr.actor.use_prefix_grouper) if mode != "disabled" else None)
        logp, ent, sum_sq = batched_token_stats(self.model, batch.to(self.device), micro_batch_size=micro_batch_size,
                                                temperature=temperature, calculate_entropy=True,
                                                calculate_sum_pi_squared=sum_sq_wanted,
                                                remove_padding=self.arr.model.use_remove_padding,
                                                prefix_grouper=self.arr.actor.use_prefix_grouper, sp=self.sp,
                                                around=routing, **budget)
        out = Batch({"old_log_probs": logp.cpu(), "entropys": ent.cpu()})
        if mode == "R2":                    # the update forwards replay this pass's routing
            out[ROUTED] = routing.result().cpu()
        if sum_sq_wanted:
            out["sum_pi_squared"] = sum_sq.cpu()
        return out

    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO update; a rank of a group adds the step's peak memory, the largest over the ranks."""
        out = self.ppo.update_policy(batch.to(self.device))
        return {**out, **parallel.peak_memory_metrics(self.device)} if self.sharded else out

    def weights(self):
        """(name, tensor) pairs a rollout engine loads after an update: full tensors gathered one FSDP2 group (a
        decoder layer) at a time when sharded; LoRA: only the adapted layers, merged."""
        if self.lora:
            return lora.engine_weights(self.model)
        return parallel.full_tensors(self.model) if self.sharded else self.model.state_dict().items()

    def save_checkpoint(self, path: Path, tokenizer) -> None:
        """HF-format weights (loadable by transformers) and tokenizer, plus optimizer and scheduler state
        (sharded: every rank gathers, rank 0 writes)."""
        save_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, tokenizer,
                               base_model=self.arr.model.path)

    def load_checkpoint(self, path: Path) -> None:
        load_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, what="actor")
