"""The engine on lathe train's rollout shape: `bench/e2e.py`'s defaults (32 random prompts of 256 tokens, n=8 samples,
512 forced new tokens; 256 sequences at once under max_num_seqs=1024, gpu_memory_utilization 0.5), four calls each
after a weight sync (prefix cache empty); per call the wall seconds and the prefill and decode steps' counts and host
seconds (`rollout.StepStats`). `--root` runs another tree's engine (its src/ and bench/) for an A/B in one call.

    python bench/rollout_steps.py [--model 0.5b] [--root .ab/old] [--out rows.json]
"""

import argparse
import json
import sys
import time
import types
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
ap.add_argument("--model", default="0.5b")
ap.add_argument("--calls", type=int, default=4)
ap.add_argument("--out", default=None)
a = ap.parse_args()
ROOT = Path(a.root).resolve()
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import rollout  # noqa: E402
from train import sync  # noqa: E402

from lathe.generation import SamplingParams  # noqa: E402


def main() -> None:
    args = types.SimpleNamespace(prompts=32, prompt_len=256, new_tokens=512, gpu_memory_utilization=0.5)
    dev = torch.device("cuda")
    engine_class = rollout.LatheEngine
    rollout.LatheEngine = lambda *x, **k: engine_class(*x, **{**k, "max_num_seqs": 1024})
    engine, prompts, _ = rollout.fixed_load_engine(a.model, dev, args)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, seed=0)
    engine.generate([p[:8] for p in prompts], SamplingParams(n=8, temperature=1.0, max_tokens=4, ignore_eos=True,
                                                             seed=1))
    sync(dev)
    stats = rollout.StepStats(engine)
    rows = []
    for _ in range(a.calls):
        engine.update_weights([])
        stats.reset()
        sync(dev)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(dev)
        wall = time.perf_counter() - start
        rows.append({"wall_s": round(wall, 4), **{k: round(v, 4) for k, v in stats.reset().items()},
                     "graph_captures": out.metrics["rollout/graph_captures"]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"root": str(ROOT), "model": a.model, "device": torch.cuda.get_device_name(dev), "calls": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
