"""Host cost of the engine's prefill steps: the rollout bench's fixed load prefilled alone (max_tokens=1), fresh
(prefix cache emptied: steps of the engine's default budget, 16384 tokens) and with its prompts cached (one step of
256 single tokens), five calls each; the device's busy time of one call of each (torch.profiler), and a cProfile
of each beside the JSON.
`--batched-tokens 8192,32768`: the fresh prefill again at each prefill step budget (the scheduler's
`max_num_batched_tokens`, set on the same engine between calls), with its device time by kernel.

    python bench/prefill_host.py [--model 0.5b] [--batched-tokens N,...] \
        --out bench/results/prefill_host_<model>_<device>.json
"""

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from rollout import fixed_load_engine  # noqa: E402
from train import git_sha, sync  # noqa: E402

from lathe.generation import SamplingParams  # noqa: E402


def main() -> None:
    from torch.profiler import ProfilerActivity, profile
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batched-tokens", default="", help="comma-separated prefill step budgets to time fresh")
    a = ap.parse_args()
    args = types.SimpleNamespace(prompts=256, prompt_len=256, new_tokens=512, gpu_memory_utilization=0.6)
    dev = torch.device("cuda")
    engine, prompts, _ = fixed_load_engine(a.model, dev, args)
    one = SamplingParams(n=1, temperature=1.0, max_tokens=1, ignore_eos=True, seed=0)
    engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=2, ignore_eos=True, seed=0))
    sync(dev)
    res = {"bench": "prefill_host", "model": a.model, "device": torch.cuda.get_device_name(dev),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_sha": git_sha(), "torch": torch.__version__,
           "fresh_s": [], "cached_s": []}

    def call(cold):
        if cold:
            engine.update_weights([])          # empties the prefix cache
        sync(dev)
        t = time.perf_counter()
        engine.generate(prompts, one)
        sync(dev)
        return time.perf_counter() - t
    for _ in range(5):
        res["fresh_s"].append(round(call(True), 4))
        res["cached_s"].append(round(call(False), 4))

    def device_kernels(cold):
        """(name, device microseconds, calls) of one call's kernels under torch.profiler, longest first."""
        if cold:
            engine.update_weights([])
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, one)
            sync(dev)
        return sorted(((e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: -k[1])
    for cold in (True, False):
        busy = sum(k[1] for k in device_kernels(cold))
        res["device_busy_ms_" + ("fresh" if cold else "cached")] = round(busy / 1e3, 2)
    for cold in (True, False):
        if cold:
            engine.update_weights([])
        sync(dev)
        pr = cProfile.Profile()
        pr.enable()
        engine.generate(prompts, one)
        sync(dev)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(45)
        Path(a.out).with_name(f"cprofile_{a.model}_{'fresh' if cold else 'cached'}.txt").write_text(s.getvalue())
    budgets = [int(x) for x in a.batched_tokens.split(",") if x]
    if budgets:
        res["budgets"] = {}
        default = engine.scheduler.max_num_batched_tokens
        for _ in range(2):          # two rounds, interleaved
            for n in budgets:
                engine.scheduler.max_num_batched_tokens = n
                row = res["budgets"].setdefault(str(n), {"fresh_s": []})
                row["fresh_s"] += [round(call(True), 4) for _ in range(3)]
        for n in budgets:
            engine.scheduler.max_num_batched_tokens = n
            kernels = device_kernels(True)
            res["budgets"][str(n)]["device_busy_ms"] = round(sum(k[1] for k in kernels) / 1e3, 2)
            res["budgets"][str(n)]["top_kernels"] = [{"name": k[:110], "ms": round(t / 1e3, 3), "calls": c}
                                                     for k, t, c in kernels[:14]]
        engine.scheduler.max_num_batched_tokens = default
    print(json.dumps(res))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
