#!/usr/bin/env bash
# GRPO of a Qwen3-8B-shaped model on one GB200 node (4 GPUs), with the settings of verl's GB200 example: the
# rollout runs eagerly (no CUDA graphs: actor_rollout_ref.rollout.enforce_eager=true) and the model's master
# weights are bf16 (fsdp_config.model_dtype=bf16). Build the image for aarch64 with docker/Dockerfile.
#
#   MODEL=/models/Qwen3-8B DATA_DIR=$HOME/data/gsm8k GPUS=4 bash examples/qwen3_8b_gb200.sh [key=value ...]
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
GPUS=${GPUS:-4}
RUN_DIR=${RUN_DIR:-checkpoints/qwen3_8b_gb200}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "qwen3_8b_gb200.sh: no $DATA_DIR/$f.parquet (set DATA_DIR)" >&2; exit 2; }
done

${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=2048 \
    data.filter_overlong_prompts=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 actor_rollout_ref.ref.fsdp_config.param_offload=true \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.enforce_eager=true \
    actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS" \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_examples \
    trainer.experiment_name=qwen3_8b_gb200 trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=5 \
    trainer.default_local_dir="$RUN_DIR" "$@"
