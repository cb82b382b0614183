#!/usr/bin/env bash
# ReTool-style GRPO on math with a Python code interpreter, shaped like verl's recipe/retool/run_qwen2_7b_dapo.sh:
# the model may run Python (examples/tools/code_interpreter.yaml: lathe's sandbox, standard library only, no
# network) as often as it likes within 16 turns, and is rewarded by lathe's math scorer on its final \boxed{}
# answer (the data sets' data_source picks it); running code earns nothing by itself.
#
#   MODEL=/models/Qwen2.5-7B-Instruct DATA_DIR=$HOME/data bash examples/code_interpreter_math.sh [key=value ...]
#
# Data: verl-schema parquet made once with
#   lathe preprocess math500 --input ../shared/data/math500 --output "$DATA_DIR/math500"   # training prompts
#   lathe preprocess aime24 --input ../shared/data/aime24 --output "$DATA_DIR/aime24"      # validation
# MATH-500 is an evaluation set: training on it only shows the pipeline working, and its scores afterwards mean
# nothing. For a real run set TRAIN_FILE to a training set in the same schema (verl's recipe trains on
# DAPO-Math-17k) and keep AIME for validation.
#
# Be honest about the model: the prompts do not teach the tool. The chat template lists the code_interpreter
# schema, and the model must already answer in the hermes tool-call format (<tool_call>{json}</tool_call>): use an
# instruct model such as Qwen2.5-*-Instruct (or Qwen3). A base model will not call the tool, and even instruct
# models call it rarely at first; verl's ReTool recipe therefore SFTs on tool-using solutions before RL
# (recipe/retool/run_qwen2_7b_sft.sh). lathe's counterpart is `lathe sft` on a multi-turn data set
# (data.messages_key=messages data.tools_key=tools; see examples/gsm8k_sft.sh for the house style); then point
# MODEL at its $RUN_DIR/global_step_N/actor/huggingface.
# The sandbox needs bubblewrap and user namespaces; the run stops at start-up with the reason when this machine
# cannot run it (or set the tool's config.sandbox_fusion_url to use a SandboxFusion service instead).
# Extra arguments go to `lathe train` after the script's keys (later keys win; --print-config shows the result).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data}
TRAIN_FILE=${TRAIN_FILE:-$DATA_DIR/math500/test.parquet}
VAL_FILE=${VAL_FILE:-$DATA_DIR/aime24/test.parquet}
TOOL_CONFIG=${TOOL_CONFIG:-$HERE/tools/code_interpreter.yaml}
GPUS=${GPUS:-8}
RUN_DIR=${RUN_DIR:-checkpoints/code_interpreter_math}
for f in "$TRAIN_FILE:math500:TRAIN_FILE" "$VAL_FILE:aime24:VAL_FILE"; do
    IFS=: read -r path name var <<< "$f"
    [[ -f $path ]] || { echo "code_interpreter_math.sh: no $path; make it with lathe preprocess $name" \
        "--input <the $name jsonl folder> --output $(dirname "$path") (or set DATA_DIR or $var)" >&2; exit 2; }
done

MAX_TURNS=16
MAX_PROMPT_LENGTH=2048
MAX_RESPONSE_LENGTH=8192          # verl's recipe: 16384 (its SFT model writes long tool-using solutions)
MAX_TOKENS_PER_GPU=$(( MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH ))

# DAPO-style clipping (clip_ratio_high=0.28) and no KL, as the recipe; rollout.name=lathe runs the agent loop.
# verl trains one epoch of DAPO-Math-17k; MATH-500's 500 prompts make about 8 steps an epoch, hence 5 epochs.
${LATHE:-lathe} train base \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false algorithm.kl_ctrl.kl_coef=0.0 \
    data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
    data.train_batch_size=64 data.max_prompt_length=$MAX_PROMPT_LENGTH \
    data.max_response_length=$MAX_RESPONSE_LENGTH \
    data.filter_overlong_prompts=true data.truncation=error data.return_raw_chat=true \
    actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$MAX_TOKENS_PER_GPU \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$(( MAX_TOKENS_PER_GPU * 4 )) \
    actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    actor_rollout_ref.rollout.name=lathe actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
    actor_rollout_ref.rollout.val_kwargs.n=30 actor_rollout_ref.rollout.val_kwargs.do_sample=true \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.6 \
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$MAX_TURNS \
    actor_rollout_ref.rollout.multi_turn.max_user_turns=$MAX_TURNS \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1024 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
    trainer.device=cuda trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS" trainer.critic_warmup=0 \
    trainer.logger='[console,tensorboard]' trainer.project_name=lathe_examples \
    trainer.experiment_name=code_interpreter_math trainer.val_before_train=true trainer.log_val_generations=20 \
    trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=5 trainer.default_local_dir="$RUN_DIR" "$@"
