#!/usr/bin/env bash
# Fully asynchronous GRPO: 4 devices train, 4 generate (written for lathe's tests)
NGPUS_TRAIN=${NGPUS_TRAIN:-4}
NGPUS_ROLLOUT=${NGPUS_ROLLOUT:-4}
python -m verl.experimental.fully_async_policy.fully_async_main \
    --config-path=config --config-name='fully_async_ppo_trainer.yaml' \
    algorithm.adv_estimator=grpo \
    data.train_files=${DATA_DIR}/train.parquet \
    data.train_batch_size=0 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.hybrid_engine=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=4 \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=$NGPUS_TRAIN \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node=$NGPUS_ROLLOUT \
    async_training.staleness_threshold=0.5 \
    async_training.trigger_parameter_sync_step=2 \
    async_training.require_batches=1
