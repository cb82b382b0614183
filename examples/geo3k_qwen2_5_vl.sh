#!/usr/bin/env bash
# GRPO of a vision-language model on geo3k (geometry problems with one diagram each), shaped like verl's
# examples/grpo_trainer/run_qwen2_5_vl-7b.sh (Qwen2.5-VL-7B-Instruct on 8 GPUs).
#
#   MODEL=/models/Qwen2.5-VL-7B-Instruct DATA_DIR=$HOME/data/geo3k bash examples/geo3k_qwen2_5_vl.sh [key=value ...]
#   MODEL=/models/Qwen2.5-VL-3B-Instruct GPUS=1 bash examples/geo3k_qwen2_5_vl.sh        # one GPU
#
# Data: verl-schema parquet (train/test) with an `images` column, made once from a local copy of hiyouga/geometry3k:
#   lathe preprocess geo3k --input <the geometry3k folder> --output "$DATA_DIR"
# Reward: verl's geo3k scorer (0.9 for the \boxed{} answer, 0.1 for the <think>...</think> format), chosen by the
# rows' data_source. The processor (image resizing, chat template) is read from the model directory. Qwen3-VL
# checkpoints run the same way. Extra arguments go to `lathe train` after the script's keys (later keys win;
# --print-config shows the result).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/geo3k}
GPUS=${GPUS:-8}
RUN_DIR=${RUN_DIR:-checkpoints/geo3k_qwen2_5_vl}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "geo3k_qwen2_5_vl.sh: no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess geo3k --input <geometry3k> --output $DATA_DIR (or set DATA_DIR)" >&2; exit 2; }
done

${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" data.image_key=images \
    data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=2048 \
    data.filter_overlong_prompts=true data.truncation=error \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20 actor_rollout_ref.ref.fsdp_config.param_offload=true \
    trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 trainer.logger='[console,tensorboard]' \
    trainer.project_name=lathe_geo3k trainer.experiment_name=qwen2_5_vl \
    trainer.default_local_dir="$RUN_DIR" trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15 \
    "$@"
