#!/usr/bin/env bash
# GRPO on GSM8K over several nodes under SLURM, in the shape of verl's AMD-cluster (MI300) tutorial: every node
# checks itself (`lathe diagnose`), a Ray head and one Ray worker per node start (scripts/slurm_ray.sbatch), then
# `lathe train` runs on the head with trainer.nnodes x trainer.n_gpus_per_node taken from the job.
#
#   NNODES=2 GPUS_PER_NODE=8 MODEL=/shared/Qwen2.5-7B-Instruct DATA_DIR=/shared/data/gsm8k \
#       bash examples/gsm8k_grpo_slurm.sh [key=value ...]
#   ROCM=1 ...                         # AMD: HIP_VISIBLE_DEVICES only, RCCL over the interface below
#
# The model, the data and RUN_DIR must be on a filesystem every node reads.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
RUN_DIR=${RUN_DIR:-$PWD/checkpoints/gsm8k_grpo_slurm}
# The network NCCL/RCCL and gloo use between nodes (`ip -br addr`; verl's tutorial: the RoCE/IB interface).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}
if [[ ${ROCM:-0} == 1 ]]; then
    # ROCm under Ray: Ray gives each worker its GPUs through HIP/CUDA_VISIBLE_DEVICES; a ROCR_VISIBLE_DEVICES
    # inherited from the job would renumber the devices under them (lathe diagnose refuses it).
    unset ROCR_VISIBLE_DEVICES
    export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}
    export CUDA_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES
fi
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "gsm8k_grpo_slurm.sh: no $DATA_DIR/$f.parquet (set DATA_DIR)" >&2; exit 2; }
done

${SBATCH:-sbatch} --nodes="$NNODES" --gpus-per-node="$GPUS_PER_NODE" --export=ALL \
    "$ROOT/scripts/slurm_ray.sbatch" base \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024 \
    data.filter_overlong_prompts=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.n=5 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.ref.fsdp_config.param_offload=true \
    trainer.device=cuda trainer.logger='[console,tensorboard]' trainer.project_name=lathe_examples \
    trainer.experiment_name=gsm8k_grpo_slurm trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15 \
    trainer.default_local_dir="$RUN_DIR" "$@"
