#!/usr/bin/env bash
# Multi-turn GRPO on GSM8K with a tool, shaped like verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh
# (Qwen2.5-3B-Instruct on 8 GPUs): the model reasons, checks its answer with the calc_gsm8k_reward tool
# (examples/tools/gsm8k_tool.yaml), may revise it, and ends with "#### <answer>"; at most 5 assistant turns.
#
#   MODEL=/models/Qwen2.5-3B-Instruct DATA_DIR=$HOME/data/gsm8k_tool bash examples/gsm8k_multiturn_tool.sh [key=value ...]
#   MODEL=/models/Qwen2.5-0.5B-Instruct GPUS=1 bash examples/gsm8k_multiturn_tool.sh      # one GPU
#
# Data: verl-schema parquet (train/test) whose rows carry a system message naming the tool and, in
# extra_info.tools_kwargs, the ground truth each trajectory's tool instance scores against; made once with
#   lathe preprocess gsm8k_tool --input <the GSM8K jsonl folder, e.g. ../shared/data/gsm8k> --output "$DATA_DIR"
# The model must already call tools in the hermes format (<tool_call>{json}</tool_call>): an instruct model such as
# Qwen2.5-*-Instruct or Qwen3. Reward: the GSM8K scorer on the final "#### <answer>" (the reward function also
# receives extra_info["tool_rewards"] and extra_info["num_turns"]); the tool's step rewards are not added.
# Extra arguments go to `lathe train` after the script's keys (later keys win; --print-config shows the result).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k_tool}
TOOL_CONFIG=${TOOL_CONFIG:-$HERE/tools/gsm8k_tool.yaml}
GPUS=${GPUS:-8}
RUN_DIR=${RUN_DIR:-checkpoints/gsm8k_multiturn_tool}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "gsm8k_multiturn_tool.sh: no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess gsm8k_tool --input <GSM8K> --output $DATA_DIR (or set DATA_DIR)" >&2; exit 2; }
done

# Multi-turn rollouts run on lathe's engine (rollout.name=lathe), which streams each turn to the tools.
${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=1024 \
    data.filter_overlong_prompts=true data.truncation=error data.return_raw_chat=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS" trainer.critic_warmup=0 \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_examples \
    trainer.experiment_name=gsm8k_multiturn_tool trainer.save_freq=-1 trainer.test_freq=20 trainer.total_epochs=15 \
    trainer.default_local_dir="$RUN_DIR" "$@"
