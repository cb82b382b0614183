#!/usr/bin/env bash
# PPO with the Megatron backend and a tensor-parallel rollout (written for lathe's tests)
set -euo pipefail
gen_tp=2
offload=True
python3 -m verl.trainer.main_ppo --config-path=config --config-name='ppo_megatron_trainer.yaml' \
    algorithm.adv_estimator=gae \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=256 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct \
    actor_rollout_ref.actor.strategy=megatron \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.param_offload=${offload} \
    actor_rollout_ref.actor.megatron.use_mbridge=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.tensor_model_parallel_size=$gen_tp \
    critic.model.path=Qwen/Qwen2.5-7B-Instruct \
    critic.ppo_mini_batch_size=64 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 2>&1 | tee ppo.log
