"""TRL's SFTTrainer on bench/sft.py's workload, in a process of its own (bench/sft.py starts it).

A prompt/completion data set (TRL then trains the completion tokens only), `bf16=True` on fp32 weights (lathe's
mixed precision), AdamW, no gradient checkpointing, `per_device_train_batch_size x gradient_accumulation_steps` =
`--batch` pairs per optimizer step. Writes the seconds of every optimizer step (`step_s_all`) and the peak GPU
memory to `--out`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--tokenizer", "--data", "--out"):
        p.add_argument(name, required=True)
    for name in ("--batch", "--micro", "--steps", "--max-length"):
        p.add_argument(name, type=int, required=True)
    args = p.parse_args()

    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.start, self.seconds = None, []

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self.start)
            print(f"trl step {len(self.seconds)}: {self.seconds[-1]:.2f} s", flush=True)

    config = SFTConfig(
        output_dir="/tmp/lathe-sft/trl-out", per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.batch // args.micro, max_length=args.max_length, learning_rate=1e-5,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=cuda,
        gradient_checkpointing=False, dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32},
        use_cpu=not cuda)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dataset = load_dataset("json", data_files=args.data, split="train")
    timer = StepTimer()
    trainer = SFTTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    out = {"step_s_all": timer.seconds,
           "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
           "settings": {"per_device_train_batch_size": args.micro, "gradient_accumulation_steps": args.batch // args.micro,
                        "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing,
                        "completion_only_loss": config.completion_only_loss, "padding_free": config.padding_free,
                        "packing": config.packing, "model_dtype": "float32"}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
