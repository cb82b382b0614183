"""Cross-field rules of FP8 training (`actor.fsdp_config.fp8_training`; lathe.train.fp8), before any model loads.
The device (an NVIDIA GPU of compute capability 8.9 or later) and torchao are checked once the trainer's device is
known, still before the model loads (`lathe.train.fp8.check_device`)."""

from __future__ import annotations

import warnings

from .errors import ProblemList
from .plan import needs_ref, trainer_devices

A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
KEY = f"{A}.fsdp_config.fp8_training"
REF_KEY = "actor_rollout_ref.ref.quantization"


def check_fp8_training(cfg, problems: ProblemList) -> None:
    """What FP8 training does not combine with yet is refused with the reason. Ulysses, gradient checkpointing,
    offload, expert parallelism (the routed experts stay bf16), fully-async training and the reference compose."""
    arr = cfg.actor_rollout_ref
    recipe = arr.actor.fsdp_config.fp8_training
    if recipe is None:
        return
    unsupported = [
        (arr.model.lora_rank > 0, f"{M}.lora_rank={arr.model.lora_rank}",
         "LoRA wraps the very projections FP8 training swaps; the frozen base would need an FP8 path of its own",
         "set lora_rank=0"),
        (arr.actor.fsdp_config.tensor_parallel_size > 1,
         f"{A}.fsdp_config.tensor_parallel_size={arr.actor.fsdp_config.tensor_parallel_size}",
         "tensor-parallel FP8 layers need torchao's float8 tensor-parallel styles, which lathe's tensor parallelism "
         "does not use", "set tensor_parallel_size=1 (FSDP over those devices)")]
    for bad, what, why, fix in unsupported:
        if bad:
            problems.add(f"{KEY}={recipe} with {what}: FP8 training beside it is not implemented yet in lathe ({why}). "
                         f"Fix: {fix}, or remove {KEY}.")


def check_fp8_reference(cfg, problems: ProblemList) -> None:
    """`ref.quantization=fp8` (`lathe.workers.reference`): the reference's own copy of lathe's decoder on one device
    takes FP8 copies of its projections; what gives it no such copy is refused, and a run without a reference
    is told the key does nothing."""
    arr = cfg.actor_rollout_ref
    scheme = arr.ref.quantization
    if scheme is None:
        return
    if scheme != "fp8":
        problems.add(f"{REF_KEY}={scheme!r}: lathe quantises the reference to fp8 only. Fix: set it to fp8 or null.")
        return
    devices = trainer_devices(cfg)
    unsupported = [
        (arr.model.lora_rank > 0, f"{M}.lora_rank={arr.model.lora_rank}",
         "under LoRA the reference is the actor itself with its adapters off, not a copy to quantise",
         f"remove {REF_KEY}"),
        (arr.model.impl == "hf", f"{M}.impl=hf", "the FP8 projections are lathe's decoder's",
         f"set {M}.impl=auto (or lathe)"),
        (devices > 1, f"{devices} trainer devices", "the reference is then sharded with FSDP2, whose shards would "
         "need FP8 copies of their own", f"remove {REF_KEY}, or train on one device"),
        (arr.ref.fsdp_config.param_offload, "actor_rollout_ref.ref.fsdp_config.param_offload=true",
         "the FP8 copies stay on the device while the offload moves the bf16 weights they replace",
         "set param_offload=false (the FP8 copies take half the bf16 weights' memory)")]
    for bad, what, why, fix in unsupported:
        if bad:
            problems.add(f"{REF_KEY}=fp8 with {what}: not implemented in lathe ({why}). Fix: {fix}.")
    if not needs_ref(cfg):
        warnings.warn(f"{REF_KEY}=fp8 has no effect in this run: no reference policy is computed (neither "
                      f"{A}.use_kl_loss nor algorithm.use_kl_in_reward is on).", UserWarning, stacklevel=4)
