"""LoRA rollout: the engine on merged weights against the engine applying the adapters itself.

    python bench/lora_engine.py [--models 0.5b,1.5b] [--rank 64] [--out bench/results/lora_engine_<device>.json]

issue 16 asks which is faster. Two engines over the same random-weight Qwen2.5 shape in bf16, rank-`--rank`
adapters on every linear layer (B random, so they act):
- "merged": the engine's model holds `W + (alpha/r) B A` (what lathe's trainer syncs: the adapted layers' merged
  weights after each update);
- "adapters": the engine's model keeps `W` and runs each LoRA layer's low-rank path at every step (what an engine
  applying the adapters itself does), with the adapters' tensors as the only thing to sync.
Reported per engine: generated tokens/s on `bench/rollout.py`'s fixed load (cold prefix cache, prefill included,
after a warm-up), and the cost of one sync: merging and copying the adapted layers (merged) against copying the
adapters alone (adapters).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import SHAPES, build_hf, device_name, git_sha, random_prompts, slug, sync  # noqa: E402

from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402
from lathe.models.lora import apply_lora, lora_layers, merged_weights  # noqa: E402


def timed_generate(engine, prompts, params, device) -> float:
    engine.update_weights([])                         # cold prefix cache
    sync(device)
    start = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    return time.perf_counter() - start


def bench(name: str, device, args) -> dict:
    shape = SHAPES[name]
    hf = build_hf(name, device, torch.bfloat16).eval()
    model = lathe_from_transformers(hf).eval()
    del hf
    apply_lora(model, rank=args.rank, alpha=2 * args.rank)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.copy_(0.01 * torch.randn(layer.lora_B.shape, device=device, generator=g))
    prompts = random_prompts(args.prompts, args.prompt_len, args.prompt_len, shape["vocab_size"], 0)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    warm = SamplingParams(n=1, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
    out = {}
    # merged: a plain model holding the merged weights
    plain = lathe_from_transformers(build_hf(name, device, torch.bfloat16)).eval()
    engine = LatheEngine(plain, eos_token_id=None, max_num_seqs=args.prompts,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    engine.update_weights(merged_weights(model))
    engine.generate([p[:8] for p in prompts], warm)
    seconds = timed_generate(engine, prompts, params, device)
    sync(device)
    start = time.perf_counter()
    engine.update_weights(merged_weights(model, only_adapted=True))
    sync(device)
    out["merged"] = {"tok_s": args.prompts * args.new_tokens / seconds, "seconds": seconds,
                     "sync_s": time.perf_counter() - start}
    engine.sleep()
    del engine, plain
    torch.cuda.empty_cache()
    # adapters: the LoRA model itself (its layers unfused: LoRA layers keep their own forward)
    engine = LatheEngine(model, eos_token_id=None, max_num_seqs=args.prompts,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    engine.generate([p[:8] for p in prompts], warm)
    seconds = timed_generate(engine, prompts, params, device)
    adapters = [(f"{path}.{part}", getattr(layer, part).detach().clone())
                for path, layer in lora_layers(model) for part in ("lora_A", "lora_B")]
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for key, tensor in adapters:
            model.get_parameter(key).copy_(tensor)
    engine.update_weights([])
    sync(device)
    out["adapters"] = {"tok_s": args.prompts * args.new_tokens / seconds, "seconds": seconds,
                       "sync_s": time.perf_counter() - start}
    out["merged_speedup"] = out["merged"]["tok_s"] / out["adapters"]["tok_s"]
    engine.sleep()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = device_name(device)
    res = {"bench": "lora_engine", "device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "git_sha": git_sha(), "torch": torch.__version__, "args": vars(args), "models": {}}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"lora_engine_{slug(name)}.json"
    for m in args.models.split(","):
        res["models"][m] = r = bench(m, device, args)
        print(m, json.dumps(r), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
