"""The reference part of a worker: the frozen policy the KL terms compare against (`actor_rollout_ref.ref`).

A copy of the actor's weights as loaded, in the reference's compute dtype, compiled like the actor; sharded with
FSDP2 on a rank of a group; with `ref.fsdp_config.param_offload` its weights wait in pinned CPU memory between
uses. Under LoRA the reference is the actor itself with its adapters off: no second copy of the weights. With
`ref.quantization=fp8` (one device, lathe's decoder) its projections multiply in FP8, as the engine's do.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from lathe.batch import Batch
from lathe.config.plan import MeshPlan
from lathe.dtypes import short_name
from lathe.engine import fp8
from lathe.models.attention import set_attention
from lathe.models.compile import maybe_compile
from lathe.models.decoder import LatheCausalLM
from lathe.models.frozen import frozen_copy
from lathe.models.lora import adapters_disabled
from lathe.train import expert_parallel, parallel, tensor_parallel, ulysses
from lathe.train.actor import use_torch_compile
from lathe.train.logprob import batched_log_probs
from lathe.train.offload import HostWeights, offload_flags
from lathe.train.precision import resolve_policy
from lathe.workers.actor import Actor

log = logging.getLogger("lathe")
FSDP_KEY = "actor_rollout_ref.ref.fsdp_config"
QUANT_KEY = "actor_rollout_ref.ref.quantization"


class Reference:
    """`compute_ref_log_prob` of the frozen reference; build it from the actor before `Actor.start_training`."""

    def __init__(self, ref_cfg, actor: Actor, mesh: MeshPlan | None = None, *, sp_size: int = 1):
        """`mesh`: the reference's (`RunPlan.mesh('ref')`; None: plain FSDP), when the actor is sharded; `sp_size`:
        its Ulysses sequence-parallel size (`RunPlan.ref_sequence_parallel_size`)."""
        self.cfg, self.device, self.remove_padding = ref_cfg, actor.device, actor.arr.model.use_remove_padding
        self.model = self.host = None
        key, tp_key = "actor_rollout_ref.ref.ulysses_sequence_parallel_size", f"{FSDP_KEY}.tensor_parallel_size"
        tp_size = mesh.tp if mesh is not None else 1
        tensor_parallel.check_model(actor.model, tp_size, tp_key, mesh.ep if mesh else 1)
        ulysses.check_model(actor.model, sp_size, key, tp_size, tp_key)
        self.sp = ulysses.sequence_parallel(sp_size, key, tp_size)
        # the actor's prefix-grouped forward (`actor.use_prefix_grouper`) for the reference's pass too: the same
        # log-probs, each prompt computed once (not beside Ulysses, which cuts the stream)
        self.prefix_grouper = actor.arr.actor.use_prefix_grouper and self.sp is None
        expert_parallel.check_model(actor.model, mesh.ep if mesh else 1, f"{FSDP_KEY}.expert_parallel_size")
        if actor.lora:                      # the actor with its adapters off
            self._actor_model = actor.model
            return
        self._actor_model = None
        policy = resolve_policy(ref_cfg.fsdp_config, self.device, key=FSDP_KEY, trainable=False)
        # sharded: built in host memory, fully_shard moves each rank's shards to the device
        self.model = frozen_copy(actor.model, policy.param_dtype,
                                 torch.device("cpu") if actor.sharded else self.device)
        set_attention(self.model, actor.arr.model.override_config.get("attn_implementation"), self.device,
                      policy.param_dtype)
        fp8_note = self._quantize(policy.param_dtype) if ref_cfg.quantization == "fp8" else ""
        offload = offload_flags(ref_cfg.fsdp_config, self.device, key=FSDP_KEY, frozen=True)["offload_params"]
        if actor.sharded:
            tensor_parallel.parallelize(self.model, tensor_parallel.tensor_parallel(mesh, self.device))
            expert_parallel.parallelize(self.model, expert_parallel.expert_parallel(mesh, self.device))
            parallel.shard(self.model, ref_cfg.fsdp_config, policy, self.device, mesh)
        maybe_compile(self.model, use_torch_compile(ref_cfg) and tp_size == 1, device=self.device)
        log.info("reference: %s weights%s%s%s", short_name(policy.param_dtype), fp8_note,
                 ", in CPU memory between uses" * offload, parallel.mesh_note(mesh) if actor.sharded else "")
        self.host = HostWeights(self.model, self.device) if offload and not actor.sharded else None

    def _quantize(self, dtype: torch.dtype) -> str:
        """`ref.quantization=fp8`: FP8 copies of the decoder layers' projections, made once (the reference never
        changes), which their forwards then multiply with (`lathe.engine.fp8`); the bf16 weights stay (a few
        layers read them directly). Returns the log's note."""
        if not isinstance(self.model, LatheCausalLM):
            raise ValueError(f"{QUANT_KEY}=fp8 quantises lathe's decoder, but this reference is "
                             f"{type(self.model).__name__}. Fix: set {QUANT_KEY}=null")
        fp8.check_device(self.device, dtype, key=QUANT_KEY,
                         dtype_key=f"{FSDP_KEY}.mixed_precision.param_dtype")
        added = fp8.quantize_model(self.model)
        return f", its projections in FP8 (+{added / 2**30:.2f} GiB)"

    def _on_device(self):
        if self._actor_model is not None:
            return adapters_disabled(self._actor_model)
        return self.host.on_device() if self.host is not None else nullcontext(self.model)

    def compute_ref_log_prob(self, batch: Batch, *, micro_batch_size: int, temperature: float, **budget) -> Batch:
        with self._on_device() as ref:
            logp, _ = batched_log_probs(ref, batch.to(self.device), micro_batch_size=micro_batch_size,
                                        temperature=temperature, remove_padding=self.remove_padding, sp=self.sp,
                                        prefix_grouper=self.prefix_grouper, **budget)
        return Batch({"ref_log_prob": logp.cpu()})
