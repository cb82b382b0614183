"""TRL's GRPOTrainer on bench/e2e.py's workload, in a process of its own (bench/e2e.py starts it).

TRL's defaults (fp32 weights, bf16 autocast, gradient checkpointing, transformers `generate`) on the same model
directory, prompts and lengths as lathe; `per_device_train_batch_size x gradient_accumulation_steps` is the
whole generation batch (prompts x n), so one TRL step = one generation batch + one optimizer step, as one
lathe step is. Writes the seconds of every step (`step_s_all`) and the peak GPU memory to `--out`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def reward_len(completions, **kwargs) -> list[float]:
    """lathe's bench reward: the response's length in characters, folded into [0, 1)."""
    return [(len(c) % 97) / 97.0 for c in completions]


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--tokenizer", "--prompts-file", "--out"):
        p.add_argument(name, required=True)
    for name in ("--n", "--prompts", "--response-len", "--steps", "--micro"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--beta", type=float, default=0.0)
    args = p.parse_args()

    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.start, self.seconds = None, []

        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self.start)
            print(f"trl step {len(self.seconds)}: {self.seconds[-1]:.2f} s", flush=True)

    seqs = args.prompts * args.n
    config = GRPOConfig(
        output_dir="/tmp/lathe-e2e/trl-out", per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=seqs // args.micro, num_generations=args.n,
        max_completion_length=args.response_len, generation_kwargs={"min_new_tokens": args.response_len},
        temperature=1.0, learning_rate=1e-6, beta=args.beta, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dataset = load_dataset("json", data_files=args.prompts_file, split="train")
    timer = StepTimer()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward_len, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    out = {"step_s_all": timer.seconds, "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
           "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
           "settings": {"per_device_train_batch_size": args.micro, "gradient_accumulation_steps": seqs // args.micro,
                        "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing,
                        "beta": args.beta, "model_dtype": "float32 (TRL default)"}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
