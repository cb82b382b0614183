#!/usr/bin/env bash
# Fully asynchronous GRPO of a vision-language model on geo3k, shaped like verl PR 6006's run (Qwen3-VL-8B-Instruct,
# verl/experimental/fully_async_policy): the trainer and the rollout on GPU pools of their own, the split from
# variables and checked against the node before anything starts, partial rollout at the weight syncs, and the
# rollout correction (sequence-level TIS + geometric rejection sampling) for the samples' staleness.
#
#   MODEL=/models/Qwen3-VL-8B-Instruct DATA_DIR=$HOME/data/geo3k bash examples/geo3k_qwen3_vl_fully_async.sh
#   NNODES=2 TRAIN_GPUS=4 ROLLOUT_GPUS=4 bash examples/geo3k_qwen3_vl_fully_async.sh [key=value ...]
#
# GPUS_PER_NODE: the GPUs of a node (default: what nvidia-smi lists, or CUDA_VISIBLE_DEVICES; without nvidia-smi
# give it). TRAIN_GPUS / ROLLOUT_GPUS: each pool's GPUs per node (default: half and half). NNODES: nodes per pool
# (multi-node: start Ray on every node first, see scripts/slurm_ray.sbatch). STALENESS, TRIGGER_SYNC,
# REQUIRE_BATCHES, PARTIAL_ROLLOUT, TOTAL_ROLLOUT_STEPS, ROLLOUT_CORRECTION: the async block.
# Data: verl-schema parquet with an `images` column, made once from a local copy of hiyouga/geometry3k:
#   lathe preprocess geo3k --input <the geometry3k folder> --output "$DATA_DIR"
# Each rollout request carries its prompt's image; an interrupted response continues under the new weights with
# its image encoded again by the new vision tower (docs/fully_async.md, docs/vision_language.md). Extra arguments
# go to `lathe train` after the script's keys (later keys win; --print-config shows the result).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-VL-8B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/geo3k}
RUN_DIR=${RUN_DIR:-checkpoints/geo3k_qwen3_vl_fully_async}
NNODES=${NNODES:-1}
me=geo3k_qwen3_vl_fully_async.sh

fail() { echo "$me: $*" >&2; exit 2; }

for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || fail "no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess geo3k --input <geometry3k> --output $DATA_DIR (or set DATA_DIR)"
done

# the node's GPUs, and the split between the two pools
if command -v nvidia-smi >/dev/null 2>&1; then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        VISIBLE=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    else
        VISIBLE=$(nvidia-smi -L | grep -c '^GPU' || true)
    fi
    GPUS_PER_NODE=${GPUS_PER_NODE:-$VISIBLE}
    (( GPUS_PER_NODE <= VISIBLE )) || fail "GPUS_PER_NODE=$GPUS_PER_NODE, but this node shows $VISIBLE GPU(s)" \
        "(nvidia-smi -L / CUDA_VISIBLE_DEVICES)"
elif [[ -z ${GPUS_PER_NODE:-} ]]; then
    fail "nvidia-smi not found, so the GPUs of this node cannot be counted; set GPUS_PER_NODE (and TRAIN_GPUS," \
        "ROLLOUT_GPUS) to run here"
fi
TRAIN_GPUS=${TRAIN_GPUS:-$((GPUS_PER_NODE / 2))}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-$((GPUS_PER_NODE - TRAIN_GPUS))}
(( TRAIN_GPUS >= 1 && ROLLOUT_GPUS >= 1 )) || fail "TRAIN_GPUS=$TRAIN_GPUS and ROLLOUT_GPUS=$ROLLOUT_GPUS: each" \
    "pool needs at least one GPU per node (GPUS_PER_NODE=$GPUS_PER_NODE)"
(( TRAIN_GPUS + ROLLOUT_GPUS <= GPUS_PER_NODE )) || fail "TRAIN_GPUS=$TRAIN_GPUS + ROLLOUT_GPUS=$ROLLOUT_GPUS =" \
    "$((TRAIN_GPUS + ROLLOUT_GPUS)) GPUs per node, but a node has GPUS_PER_NODE=$GPUS_PER_NODE; lower one of them"

# verl's defaults (`base`), then the run's keys
${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    algorithm.rollout_correction="${ROLLOUT_CORRECTION:-decoupled_geo_rs_seq_tis}" \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" data.image_key=images \
    data.train_batch_size=0 data.gen_batch_size=1 data.max_prompt_length=1024 data.max_response_length=2048 \
    data.filter_overlong_prompts=true data.truncation=error \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true actor_rollout_ref.hybrid_engine=false \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=10240 \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.calculate_log_probs=true \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=10240 \
    async_training.staleness_threshold="${STALENESS:-0.1}" \
    async_training.trigger_parameter_sync_step="${TRIGGER_SYNC:-4}" \
    async_training.require_batches="${REQUIRE_BATCHES:-2}" \
    async_training.partial_rollout="${PARTIAL_ROLLOUT:-true}" \
    async_training.use_rollout_log_probs=true async_training.compute_prox_log_prob=true \
    trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$TRAIN_GPUS" \
    rollout.nnodes="$NNODES" rollout.n_gpus_per_node="$ROLLOUT_GPUS" \
    rollout.total_rollout_steps="${TOTAL_ROLLOUT_STEPS:-51200}" rollout.test_freq=5 \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_geo3k \
    trainer.experiment_name=qwen3_vl_8b_fully_async trainer.val_before_train=false trainer.test_freq=-1 \
    trainer.save_freq=20 trainer.total_epochs=200 trainer.default_local_dir="$RUN_DIR" \
    "$@"
