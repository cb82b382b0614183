#!/usr/bin/env bash
# Fully asynchronous GRPO shaped like verl's fully-async example (verl PR 6006: 16 rollout + 16 training GPUs),
# with a text model on GSM8K: the GPU split, the async block and the data path come from variables, and the split
# is checked against the machine before anything starts. Multi-node: start Ray on every node first (see
# scripts/slurm_ray.sbatch) and set NNODES; lathe places each pool on whole nodes.
#
#   DATA_DIR=/data/gsm8k MODEL=/models/Qwen2.5-7B-Instruct N_GPUS_ROLLOUT=4 bash scripts/fully_async.sh
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA_DIR=${DATA_DIR:-${LATHE_DATA:-./data}/gsm8k}     # train.parquet / test.parquet from `lathe preprocess gsm8k`
RUN_DIR=${RUN_DIR:-checkpoints/fully_async}
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
N_GPUS_ROLLOUT=${N_GPUS_ROLLOUT:-$((NGPUS_PER_NODE / 2))}
N_GPUS_TRAINING=${N_GPUS_TRAINING:-$((NGPUS_PER_NODE - N_GPUS_ROLLOUT))}

if (( N_GPUS_ROLLOUT < 1 || N_GPUS_TRAINING < 1 )); then
    echo "fully_async.sh: need at least one rollout and one training GPU per node (NGPUS_PER_NODE=$NGPUS_PER_NODE," \
         "N_GPUS_ROLLOUT=$N_GPUS_ROLLOUT, N_GPUS_TRAINING=$N_GPUS_TRAINING)" >&2
    exit 2
fi
if (( N_GPUS_ROLLOUT + N_GPUS_TRAINING > NGPUS_PER_NODE )); then
    echo "fully_async.sh: N_GPUS_ROLLOUT=$N_GPUS_ROLLOUT + N_GPUS_TRAINING=$N_GPUS_TRAINING exceed the" \
         "$NGPUS_PER_NODE GPUs of this node" >&2
    exit 2
fi
for f in train test; do
    [[ -f "$DATA_DIR/$f.parquet" ]] || { echo "fully_async.sh: $DATA_DIR/$f.parquet not found (set DATA_DIR)" >&2; exit 2; }
done

# verl's defaults (`base`), then the run's keys, as verl's script passes them
lathe train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.max_prompt_length=512 data.max_response_length=2048 data.train_batch_size=0 data.gen_batch_size=1 \
    data.filter_overlong_prompts=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.hybrid_engine=false \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.gpu_memory_utilization=0.85 \
    actor_rollout_ref.rollout.calculate_log_probs=true \
    algorithm.rollout_correction="${ROLLOUT_CORRECTION:-sequence_tis_geometric_rs}" \
    async_training.compute_prox_log_prob=true \
    trainer.device=cuda trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$N_GPUS_TRAINING" \
    rollout.nnodes="$NNODES" rollout.n_gpus_per_node="$N_GPUS_ROLLOUT" \
    rollout.total_rollout_steps="${TOTAL_ROLLOUT_STEPS:-51200}" rollout.test_freq=10 \
    async_training.staleness_threshold=10 async_training.trigger_parameter_sync_step=5 \
    async_training.require_batches=2 async_training.partial_rollout=true \
    trainer.save_freq=50 trainer.test_freq=-1 trainer.logger='[console,tensorboard]' \
    trainer.default_local_dir="$RUN_DIR" "$@"
