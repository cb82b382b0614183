#!/usr/bin/env bash
# SFT on GSM8K's worked solutions, shaped like verl's examples/sft/gsm8k/run_qwen_05_*.sh (fsdp_sft_trainer).
#
#   MODEL=/models/Qwen2.5-0.5B-Instruct DATA_DIR=$HOME/data/gsm8k bash examples/gsm8k_sft.sh [key=value ...]
#
# Data: the verl-schema parquet of `lathe preprocess gsm8k --input <GSM8K> --output "$DATA_DIR"`, whose extra_info
# holds each question and its full solution (verl's recipe reads the same columns). The last checkpoint's
# $RUN_DIR/global_step_N/actor/huggingface is a Hugging Face model: start GRPO from it with
#   MODEL=$RUN_DIR/global_step_N/actor/huggingface bash examples/gsm8k_grpo_1gpu.sh
# Extra arguments go to `lathe sft` after the script's keys (later keys win; --print-config shows the result);
# trainer.n_gpus_per_node=N trains on N GPUs (Ray workers, FSDP2).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
RUN_DIR=${RUN_DIR:-checkpoints/gsm8k_sft}
for f in train test; do
    [[ -f $DATA_DIR/$f.parquet ]] || { echo "gsm8k_sft.sh: no $DATA_DIR/$f.parquet; make it with" \
        "lathe preprocess gsm8k --input <GSM8K> --output $DATA_DIR (or set DATA_DIR)" >&2; exit 2; }
done

${LATHE:-lathe} sft \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.prompt_key=extra_info data.prompt_dict_keys='[question]' \
    data.response_key=extra_info data.response_dict_keys='[answer]' \
    data.train_batch_size=256 data.micro_batch_size_per_gpu=4 data.max_length=1024 \
    model.partial_pretrain="$MODEL" model.enable_gradient_checkpointing=true \
    optim.lr=1e-5 \
    trainer.device=cuda trainer.n_gpus_per_node=1 trainer.logger='[console,tensorboard]' \
    trainer.project_name=gsm8k-sft trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct \
    trainer.total_epochs=2 trainer.test_freq=10 trainer.default_local_dir="$RUN_DIR" "$@"
