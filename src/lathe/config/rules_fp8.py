"""Cross-field rules of FP8 training (`actor.fsdp_config.fp8_training`; lathe.train.fp8), before any model loads.
The device (an NVIDIA GPU of compute capability 8.9 or later) and torchao are checked once the trainer's device is
known, still before the model loads (`lathe.train.fp8.check_device`)."""

from __future__ import annotations

from .errors import ProblemList

A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
KEY = f"{A}.fsdp_config.fp8_training"


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
