#!/usr/bin/env bash
# Multi-turn GRPO of a vision-language model on geo3k with a tool, shaped like verl's
# examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn.sh (Qwen2.5-VL-3B-Instruct on 8 GPUs): the model
# reads the diagram, reasons, checks its answer with the calc_geo3k_reward tool (examples/tools/geo3k_tool.yaml), may
# revise it, and ends with its \boxed{} answer; at most 5 assistant turns (verl's multi_turn.max_turns=5).
#
#   MODEL=/models/Qwen2.5-VL-3B-Instruct DATA_DIR=$HOME/data/geo3k_tool bash examples/geo3k_multiturn_qwen2_5_vl.sh [key=value ...]
#   GPUS=4 bash examples/geo3k_multiturn_qwen2_5_vl.sh                  # verl's 4-GPU variant of the recipe
#
# Data: verl-schema parquet (train/test) with an `images` column, whose rows carry a system message naming the tool
# and, in extra_info.tools_kwargs, the ground truth each trajectory's tool instance scores against; made once from a
# local copy of hiyouga/geometry3k with
#   lathe preprocess geo3k_tool --input <the geometry3k folder> --output "$DATA_DIR"
# The model must already call tools in the hermes format (<tool_call>{json}</tool_call>), as Qwen2.5-VL-*-Instruct
# does; every turn carries the prompt's image, tool answers are text. Reward: verl's geo3k scorer on the whole
# trajectory (0.9 for the \boxed{} answer, 0.1 for the <think>...</think> format), chosen by the rows' data_source;
# the reward function also receives extra_info["tool_rewards"] and extra_info["num_turns"], and the tool's step
# rewards are not added. verl's rollout.tensor_model_parallel_size=2 is left out (lathe runs one engine per GPU).
# Extra arguments go to `lathe train` after the script's keys (later keys win; --print-config shows the result).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL=${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/geo3k_tool}
TOOL_CONFIG=${TOOL_CONFIG:-$HERE/tools/geo3k_tool.yaml}
GPUS=${GPUS:-8}
RUN_DIR=${RUN_DIR:-checkpoints/geo3k_multiturn_qwen2_5_vl}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "geo3k_multiturn_qwen2_5_vl.sh: no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess geo3k_tool --input <geometry3k> --output $DATA_DIR (or set DATA_DIR)" >&2; exit 2; }
done

# Multi-turn rollouts run on lathe's engine (rollout.name=lathe), which streams each turn to the tools.
${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" data.image_key=images \
    data.train_batch_size=256 data.max_prompt_length=2048 data.max_response_length=2048 \
    data.filter_overlong_prompts=true data.truncation=error data.return_raw_chat=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=true \
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
    trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS" trainer.critic_warmup=0 \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_geo3k \
    trainer.experiment_name=geo3k_multiturn_qwen2_5_vl trainer.save_freq=-1 trainer.test_freq=20 \
    trainer.total_epochs=15 trainer.default_local_dir="$RUN_DIR" "$@"
