#!/usr/bin/env bash
# A verl-style SFT launch script for `lathe migrate`'s tests (the newer trainer, its fsdp engine).
set -xeuo pipefail

NPROC=${NPROC:-4}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
SP=${SP:-1}

torchrun --standalone --nnodes=1 --nproc_per_node=${NPROC} \
    -m verl.trainer.sft_trainer \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.messages_key=messages \
    data.micro_batch_size_per_gpu=4 \
    optim.lr=1e-4 \
    engine=fsdp \
    engine.ulysses_sequence_parallel_size=${SP} \
    model.path=${MODEL} \
    trainer.default_local_dir=$HOME/ckpt/sft \
    trainer.total_epochs=1 "$@"
