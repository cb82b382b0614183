"""Host time of a prefill step's input preparation (`ModelRunner.prepare_prefill`), on any device.

    python bench/prefill_inputs.py [--prompts 32] [--prompt-len 256] [--repeats 50] [--out bench/results/prefill_inputs_<device>.json]

A tiny random model on the CPU (the function is host work: ids, positions, KV slots, attention layout, their
copies to the device), an engine whose scheduler has admitted `--prompts` fresh prompts of `--prompt-len` tokens
(the fixed load's prefill step: 32 x 256 = 8192 tokens), and the median of `--repeats` calls, each in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402
from lathe.models.config import LatheConfig  # noqa: E402
from lathe.models.decoder import LatheCausalLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LatheConfig(architecture="Qwen2ForCausalLM", vocab_size=1000, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=4096, qkv_bias=True)
    engine = LatheEngine(LatheCausalLM(cfg).eval(), eos_token_id=None, num_kv_blocks=4096,
                         max_num_seqs=args.prompts, max_num_batched_tokens=args.prompts * args.prompt_len,
                         reserve_new_tokens=False)
    prompts = [torch.randint(0, 1000, (args.prompt_len,)).tolist() for _ in range(args.prompts)]
    seqs = engine._make_sequences(prompts, SamplingParams(n=1, max_tokens=8, ignore_eos=True, seed=0))
    engine.scheduler.new_call()
    for seq in seqs:
        engine.scheduler.add(seq)
    batch, is_prefill, _ = engine.scheduler.schedule()
    if not is_prefill:
        raise RuntimeError("prefill_inputs: the first scheduled step is not a prefill")
    num_new = [s.num_scheduled_tokens for s in batch]
    times = []
    for _ in range(args.repeats + 3):
        start = time.perf_counter()
        engine.runner.prepare_prefill(batch, num_new)
        times.append((time.perf_counter() - start) * 1e3)
    times = times[3:]
    res = {**result_header("prefill_inputs", torch.device("cpu"), args), "sequences": len(batch),
           "tokens": sum(num_new), "ms_median": statistics.median(times), "ms_min": min(times)}
    print(f"prepare_prefill: {len(batch)} sequences, {sum(num_new)} tokens: {res['ms_median']:.3f} ms median",
          flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
