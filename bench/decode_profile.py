"""Where a decode step's time goes: host work per part, device time per part, and the device's idle gaps.

    python bench/decode_profile.py [--models 0.5b,1.5b] [--prompts 256] [--prompt-len 256] [--new-tokens 512]

Runs `bench/rollout.py`'s fixed load through the engine as users get it (CUDA graphs, compiled layers,
overlapped scheduling), with every host-side part of a step timed by `perf_counter` and CUDA events around
each step's graph run. Reported per decode step (medians over the run's decode steps):
wall time; host milliseconds in each part; device milliseconds of the graph-replayed step (forward, lm_head and
sampler, with the input copies just before it); and the
share of the run's span in which the device had no step's work queued (host-bound time). Then
torch.profiler tables of graph-replayed decode steps, which kernels the device time goes to: a short call's first
8 steps (contexts at the prompt length) and 8 steps halfway through a full call (contexts at the run's mean).
Writes JSON (device, date, git sha) to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (SHAPES, device_name, fixed_load_engine, git_sha, hbm_bandwidth, kv_bytes_per_token,  # noqa: E402
                    profile_summary, roofline_tok_s, slug, summarize_profile, sync, weight_bytes)

import lathe.engine.llm_engine as llm  # noqa: E402
from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402


class Probe:
    """Accumulates host seconds per named part of the current step, and device events per step."""

    def __init__(self):
        self.host = defaultdict(float)
        self.steps: list[dict] = []
        self.events: list[tuple] = []
        self.on = False

    def wrap(self, obj, name: str, label: str | None = None):
        fn = getattr(obj, name)
        label = label or name

        @functools.wraps(fn)
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.host[label] += time.perf_counter() - t
        setattr(obj, name, timed)


def instrument(engine: LatheEngine, probe: Probe) -> None:
    probe.wrap(engine.scheduler, "schedule")
    probe.wrap(engine, "_resolve", "resolve")
    probe.wrap(engine.kv_cache, "copy_blocks")
    probe.wrap(engine.runner, "decode_inputs")
    probe.wrap(llm._InFlight, "add_placeholders")
    probe.wrap(llm._InFlight, "__init__", "inflight_copy")
    probe.wrap(engine, "_pending_inputs", "pending_inputs")
    graphs = engine.runner.graphs
    if graphs is not None:
        probe.wrap(graphs, "_sync_tables", "graph_tables")
        run = graphs.run

        def graph_run(*a, **k):
            if not probe.on:
                return run(*a, **k)
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            t = time.perf_counter()
            out = run(*a, **k)
            probe.host["graph_run"] += time.perf_counter() - t
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            probe.events.append((e0, e1, len(a[0])))
            return out
        graphs.run = graph_run
    sample = llm.sample_on_device

    def sample_timed(logits, seqs):
        if not probe.on:
            return sample(logits, seqs)
        t = time.perf_counter()
        out = sample(logits, seqs)
        probe.host["sample"] += time.perf_counter() - t
        return out
    llm.sample_on_device = sample_timed
    step = engine.step

    def step_timed():
        if not probe.on:
            return step()
        probe.host.clear()
        t = time.perf_counter()
        n = step()
        wall = time.perf_counter() - t
        probe.steps.append({"wall": wall, "n": n, "host": dict(probe.host),
                            "decode": "graph_run" in probe.host})
        return n
    engine.step = step_timed


def profile_steps(engine: LatheEngine, prompts, params, device, first: int, count: int, top: int) -> dict:
    """`profile_summary` of engine steps first..first+count-1 of one `generate` call (kernels launched by them)."""
    from torch.profiler import ProfilerActivity, profile
    step, seen, prof = engine.step, [0], profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def stepped():
        i = seen[0]
        seen[0] += 1
        if i == first:
            sync(device)
            prof.__enter__()
        try:
            return step()
        finally:
            if i == first + count - 1:
                sync(device)
                prof.__exit__(None, None, None)
    engine.step = stepped
    try:
        engine.generate(prompts, params)
    finally:
        engine.step = step
    if seen[0] < first + count:
        raise RuntimeError(f"decode_profile: the call ran {seen[0]} steps, fewer than the {first + count} profiled")
    return summarize_profile(prof, device, top)


def kernel_kind(name: str, calls: int, steps: int) -> str:
    """A decode kernel's kind in `where_time_goes`: the lm_head is the one cuBLAS launch per step."""
    if name == "_decode_kernel":
        return "attention"
    if name.startswith("nvjet") or "gemm" in name:
        return "lm_head" if calls == steps else "matmul"
    if "silu" in name:
        return "swiglu"
    if "rsqrt" in name:
        return "norms"
    return "sampler" if name in ("_chunk_kernel", "_pick_kernel") else "other"


def where_time_goes(table: dict, steps: int, rows: int, context: float, wbytes: int, kv_per_token: int,
                    bandwidth: float) -> dict:
    """A decode step's kernel time by kind (`table`: `profile_summary` of `steps` steps) against that step's
    roofline: the weights and `rows` sequences' KV at `context` tokens read once at `bandwidth` bytes/s."""
    per: dict[str, float] = defaultdict(float)
    for k in table["top"]:
        per[kernel_kind(k["name"], k["calls"], steps)] += k["ms"] / steps
    weights_ms, kv_ms = wbytes / bandwidth * 1e3, rows * context * kv_per_token / bandwidth * 1e3
    step_ms = table["device_ms"] / steps
    return {"step_device_ms": round(step_ms, 4), "context": context, "rows": rows,
            "by_kind_ms": {c: round(v, 4) for c, v in sorted(per.items(), key=lambda z: -z[1])},
            "roofline_step_ms": round(weights_ms + kv_ms, 4),
            "step_fraction_of_roofline": round((weights_ms + kv_ms) / step_ms, 4),
            "attention_fraction_of_kv_read": round(kv_ms / per["attention"], 4) if per["attention"] else None,
            "matmuls_incl_lm_head_fraction_of_weight_read": round(weights_ms / (per["matmul"] + per["lm_head"]), 4)
            if per["matmul"] + per["lm_head"] else None,
            "no_bytes_in_roofline_ms": round(sum(per[c] for c in ("swiglu", "norms", "sampler", "other")), 4)}


def med(xs):
    return statistics.median(xs) if xs else 0.0


def profile_model(name: str, device, args) -> dict:
    shape = SHAPES[name]
    engine, prompts, params = fixed_load_engine(name, device, args)
    model = engine.model
    probe = Probe()
    instrument(engine, probe)
    engine.generate(prompts, params)            # warm-up: compile, capture every bucket
    sync(device)
    plain = []
    for _ in range(2):
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(device)
        plain.append(time.perf_counter() - t)
    probe.on = True
    t = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    probed = time.perf_counter() - t
    probe.on = False
    decode = [s for s in probe.steps if s["decode"]]
    parts = sorted({k for s in decode for k in s["host"]})
    fwd = [a.elapsed_time(b) for a, b, n in probe.events]
    span = probe.events[0][0].elapsed_time(probe.events[-1][1]) if probe.events else 0.0
    busy = sum(fwd)
    tokens = sum(len(t) for t in out.token_ids)
    bandwidth = hbm_bandwidth(device_name(device))
    roof = roofline_tok_s(shape, weight_bytes(model), [len(p) for p in prompts], [len(t) for t in out.token_ids],
                          bandwidth) if bandwidth else None
    result = {
        "tok_s": [tokens / s for s in plain], "tok_s_probed": tokens / probed,
        "roofline_tok_s": roof, "roofline_fraction": [tokens / s / roof for s in plain] if roof else None,
        "decode_steps": len(decode), "prefill_steps": len(probe.steps) - len(decode),
        "decode_wall_ms_median": 1e3 * med([s["wall"] for s in decode]),
        "decode_host_ms_median": {k: 1e3 * med([s["host"].get(k, 0.0) for s in decode]) for k in parts},
        "decode_device_ms_median": med(fwd),
        "device_busy_fraction_of_decode_span": busy / span if span else None,
        "prefill_wall_s_total": sum(s["wall"] for s in probe.steps if not s["decode"]),
        "decode_wall_s_total": sum(s["wall"] for s in decode),
    }
    # kernels of a few graph-replayed decode steps
    short = SamplingParams(n=1, temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)
    result["kernels_8_tokens"] = profile_summary(lambda: engine.generate(prompts, short), device, top=40)
    # and of 8 decode steps halfway through the run, where the contexts are the run's mean
    middle = result["prefill_steps"] + len(decode) // 2
    result["kernels_8_mid_run_steps"] = {"first_step": middle,
                                         **profile_steps(engine, prompts, params, device, middle, 8, top=40)}
    if bandwidth:      # the prompt, the tokens before the first profiled step (the prefill's one too), half of 8
        context = args.prompt_len + (middle - result["prefill_steps"]) + 1 + 4
        result["where_time_goes"] = where_time_goes(result["kernels_8_mid_run_steps"], 8, len(prompts), context,
                                                    weight_bytes(model), kv_bytes_per_token(shape), bandwidth)
    engine.sleep()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--label", default="")
    ap.add_argument("--git-sha", default=None, help="the tree's sha where .git is stale (the device copy)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    name = device_name(device)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"decode_profile_{slug(name)}.json"
    res = {"bench": "decode_profile", "label": args.label, "device": name,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "git_sha": args.git_sha or git_sha(),
           "torch": torch.__version__, "args": vars(args), "models": {}}
    for m in args.models.split(","):
        res["models"][m] = r = profile_model(m, device, args)
        print(m, json.dumps({k: v for k, v in r.items() if not k.startswith("kernels_")}, indent=1), flush=True)
        for key in ("kernels_8_tokens", "kernels_8_mid_run_steps"):
            top = r[key]["top"][:14]
            print(key, round(r[key]["device_ms"], 3), "ms;", "; ".join(
                f"{k['name'][:40]} {k['ms']:.3f}/{k['calls']}" for k in top), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
