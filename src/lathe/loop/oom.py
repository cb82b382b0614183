"""Out of memory, explained: which phase of the step ran out, how much it asked for, and the keys that lower that
phase's memory (verl's names)."""

from __future__ import annotations

A, R, REF, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic"
ROLLOUT = [f"{R}.gpu_memory_utilization (lower: a smaller KV cache)", f"{R}.max_num_seqs",
           f"{R}.max_num_batched_tokens"]
PHASE_KEYS = {
    "gen": ROLLOUT, "gen_max": ROLLOUT,
    "old_log_prob": [f"{R}.log_prob_micro_batch_size_per_gpu",
                     f"{R}.log_prob_max_token_len_per_gpu (with {R}.log_prob_use_dynamic_bsz=true)"],
    "ref": [f"{REF}.log_prob_micro_batch_size_per_gpu", f"{REF}.fsdp_config.param_offload=true"],
    "teacher": [f"{REF}.log_prob_micro_batch_size_per_gpu (the teachers' micro-batches are the reference's)",
                f"{REF}.fsdp_config.param_offload=true (the teachers are placed like the reference)",
                "distillation.distillation_loss.topk (with loss_mode=forward_kl_topk)"],
    "values": [f"{C}.forward_micro_batch_size_per_gpu", f"{C}.forward_max_token_len_per_gpu (with "
               f"{C}.use_dynamic_bsz=true)"],
    "update_critic": [f"{C}.ppo_micro_batch_size_per_gpu", f"{C}.ppo_max_token_len_per_gpu (with "
                      f"{C}.use_dynamic_bsz=true)", f"{C}.model.enable_gradient_checkpointing=true (with "
                      f"{C}.model.gradient_checkpointing_layers set: raise it, or null for every layer)",
                      f"{C}.model.fsdp_config.param_offload=true / optimizer_offload=true"],
    "update_actor": [f"{A}.ppo_micro_batch_size_per_gpu", f"{A}.ppo_max_token_len_per_gpu (with {A}.use_dynamic_bsz=true)",
                     "actor_rollout_ref.model.enable_gradient_checkpointing=true (with actor_rollout_ref.model."
                     "gradient_checkpointing_layers set: raise it, or null for every layer)",
                     f"{A}.fsdp_config.param_offload=true / optimizer_offload=true"],
    "update_weights": [f"{A}.fsdp_config.param_offload=true", f"{R}.gpu_memory_utilization (lower)"],
}


class OutOfMemory(RuntimeError):
    """A phase of the step ran out of device memory (the message names it and the keys to turn)."""


def explain(err: BaseException, phase: str | None) -> OutOfMemory:
    asked = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    keys = PHASE_KEYS.get(phase or "", [])
    where = f"during {phase}" if phase else "outside a timed phase (start-up or validation)"
    fix = ("; ".join(keys) if keys else f"{R}.gpu_memory_utilization, the micro-batch sizes, offload "
           f"({A}.fsdp_config.param_offload / optimizer_offload)")
    return OutOfMemory(f"out of device memory {where}: {asked}. Keys that lower it: {fix}. The memory plan printed "
                       "at start-up shows what else lives on the device.")
