#!/usr/bin/env bash
# GRPO on GSM8K through a custom agent loop (verl's AgentLoopBase, examples/agents/self_check.py): the model answers,
# and when its answer has no "#### <number>" line the loop asks once more (a user turn the model does not train on).
# verl's rollout.agent keys: agent_loop_config_path lists the loops (examples/agents/loops.yaml), default_agent_loop
# picks one for rows without an agent_name column.
#
#   MODEL=/models/Qwen2.5-0.5B-Instruct DATA_DIR=$HOME/data/gsm8k bash examples/gsm8k_custom_agent.sh [key=value ...]
#
# Data: verl-schema parquet (train/test), made once with
#   lathe preprocess gsm8k --input <the GSM8K jsonl folder, e.g. ../shared/data/gsm8k> --output "$DATA_DIR"
# Extra arguments go to `lathe train` after the script's keys (later keys win; --print-config shows the result).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
GPUS=${GPUS:-1}
RUN_DIR=${RUN_DIR:-checkpoints/gsm8k_custom_agent}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "gsm8k_custom_agent.sh: no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess gsm8k --input <GSM8K> --output $DATA_DIR (or set DATA_DIR)" >&2; exit 2; }
done
export PYTHONPATH="$HERE/agents${PYTHONPATH:+:$PYTHONPATH}"      # where loops.yaml's _target_ is imported from

${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 data.max_prompt_length=512 data.max_response_length=1024 \
    data.filter_overlong_prompts=true data.truncation=error \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agents/loops.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=self_check \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS" trainer.critic_warmup=0 \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_examples \
    trainer.experiment_name=gsm8k_custom_agent trainer.save_freq=-1 trainer.test_freq=20 trainer.total_epochs=5 \
    trainer.default_local_dir="$RUN_DIR" "$@"
