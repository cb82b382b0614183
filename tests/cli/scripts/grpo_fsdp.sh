#!/usr/bin/env bash
# GRPO on GSM8K with the FSDP backend, in the style of verl's example scripts (written for lathe's tests)
set -xeuo pipefail
DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
train_files="['$HOME/data/gsm8k/train.parquet']"
max_prompt_length=$((1024 * 1))
max_response_length=$((1024 * 2))
case "${DEVICE}" in
    gpu) offload=False ;;
    npu) offload=True ;;
esac
ACTOR=(
    actor_rollout_ref.model.path="${MODEL_PATH}"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(((max_prompt_length + max_response_length) * 2))
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload}
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1
)
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.train_batch_size=128 \
    data.max_prompt_length=$max_prompt_length \
    data.max_response_length=$max_response_length \
    "${ACTOR[@]}" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    +actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True \
    trainer.logger='["console"]' \
    trainer.experiment_name=qwen3_8b_$(date +%Y%m%d) \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 "$@"
