"""Where the engine's steps spend their time on a fixed load: the host's part of each step, and the prefill's phases.

    python bench/step_probe.py [--models 0.5b,1.5b] [--batched-tokens 8192,16384] [--repeats 4]
                               [--out bench/results/step_probe_<device>.json]

The fixed load of `bench/rollout.py` (256 prompts of 256 tokens, 512 forced new tokens, random-weight bf16
Qwen2.5 shapes) on lathe's engine, warmed by two whole runs; then, per model:
- `unsynced_runs`: cold runs as the engine runs them (no syncs added) at each step token budget: every step's host
  wall time (a step's host time includes waiting for the device's previous step), the decode steps slower than
  3x the median, the garbage collector's passes;
- `decode_step_phases`: a cold run with the host time of each decode step's parts (schedule, resolve,
  placeholders, the graph's input and table copies, ...), for the median step and every step slower than 2.5x it;
- `host_profile`: cProfile of one cold run, functions by own time;
- `prefill_steps`: one run with the prefill steps split into phases by device syncs (which costs the overlap the
  engine normally has: the phases' sum is not the step's time in an unsynced run);
- `profile`: one prefill step under torch.profiler (device kernels and host ops by total time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from rollout import fixed_load_engine  # noqa: E402
from train import result_header, write_result  # noqa: E402

from lathe.engine import llm_engine, model_runner  # noqa: E402


def timed_prefills(engine, prompts, params) -> list[dict]:
    """One run of the load with each prefill step's phases timed (device synced at each boundary)."""
    runner, rows = engine.runner, []
    prepare, hidden = runner.prepare_prefill, model_runner.hidden_states
    sample = llm_engine.sample_on_device
    schedule = engine.scheduler.schedule
    now = {}

    def mark(name):
        torch.cuda.synchronize()
        t = time.perf_counter()
        now.setdefault("phases", {})[name] = t - now["t"]
        now["t"] = t

    def t_schedule():
        torch.cuda.synchronize()
        now.clear()
        now["t"] = time.perf_counter()
        out = schedule()
        mark("schedule")
        now["prefill"] = out[1]
        now["tokens"] = sum(s.num_scheduled_tokens for s in out[0])   # (reset to 0 once the step has run)
        return out

    def t_prepare(*a, **k):
        out = prepare(*a, **k)
        mark("prepare_inputs")
        return out

    def t_hidden(*a, **k):
        out = hidden(*a, **k)
        mark("layers")
        return out

    def t_sample(*a, **k):
        if now.get("prefill"):
            mark("lm_head")
        out = sample(*a, **k)
        if now.get("prefill"):
            mark("sample")
        return out

    step = engine.step

    def t_step():
        start = time.perf_counter()
        n = step()
        if now.get("prefill"):
            torch.cuda.synchronize()
            rows.append({"tokens": now["tokens"], "wall_s": time.perf_counter() - start, **now["phases"]})
        return n

    engine.scheduler.schedule, runner.prepare_prefill = t_schedule, t_prepare
    model_runner.hidden_states, llm_engine.sample_on_device, engine.step = t_hidden, t_sample, t_step
    try:
        engine.update_weights([])
        engine.generate(prompts, params)
    finally:
        engine.scheduler.schedule, runner.prepare_prefill = schedule, prepare
        model_runner.hidden_states, llm_engine.sample_on_device, engine.step = hidden, sample, step
    return rows


def profiled_prefill(engine, prompts, params) -> dict:
    """torch.profiler over the load's first prefill step (prefix cache dropped first)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    step, done = engine.step, []

    def first_step():
        if done:
            return step()
        done.append(True)
        torch.cuda.synchronize()
        prof.start()
        n = step()
        torch.cuda.synchronize()
        prof.stop()
        return n

    engine.step = first_step
    try:
        engine.update_weights([])
        engine.generate(prompts, params)
    finally:
        engine.step = step
    events = prof.key_averages()
    cuda = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:25]
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    return {"device_ms_total": sum(e.self_device_time_total for e in events) / 1e3,
            "host_ms_total": sum(e.self_cpu_time_total for e in events) / 1e3,
            "kernels": [{"name": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count} for e in cuda],
            "host_self": [{"name": e.key[:120], "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in cpu]}


def unsynced_steps(engine, prompts, params, repeats: int) -> list[dict]:
    """`repeats` cold runs of the load as the engine runs it (no syncs): each step's kind and host wall time, the
    garbage collector's passes (generation, seconds) and where in the run they fell."""
    import gc
    step, schedule = engine.step, engine.scheduler.schedule
    runs, cur = [], {}

    def t_schedule():
        out = schedule()
        cur["kind"] = "prefill" if out[1] else "decode"
        return out

    def t_step():
        cur["kind"] = None
        start = time.perf_counter()
        n = step()
        cur["steps"].append((cur["kind"], time.perf_counter() - start))
        return n

    def on_gc(phase, info):
        if phase == "start":
            cur["gc_start"] = time.perf_counter()
        else:
            cur["gc"].append({"generation": info["generation"], "step": len(cur["steps"]),
                              "s": time.perf_counter() - cur["gc_start"]})

    engine.step, engine.scheduler.schedule = t_step, t_schedule
    gc.callbacks.append(on_gc)
    try:
        for _ in range(repeats):
            engine.update_weights([])
            torch.cuda.synchronize()
            cur.update(steps=[], gc=[])
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            steps = cur["steps"]
            pre = [w for k, w in steps if k == "prefill"]
            dec = [w for k, w in steps if k == "decode"]
            dec_sorted = sorted(dec)
            runs.append({"wall_s": wall, "prefill_ms": [round(w * 1e3, 2) for w in pre],
                         "decode_s": sum(dec), "decode_ms_median": dec_sorted[len(dec) // 2] * 1e3,
                         "decode_ms_slowest": [round(w * 1e3, 2) for w in dec_sorted[-8:]],
                         "slow_decode_steps": [(i, round(w * 1e3, 2)) for i, (k, w) in enumerate(steps)
                                               if k == "decode" and w > 3 * dec_sorted[len(dec) // 2]],
                         "gc": list(cur["gc"])})
    finally:
        engine.step, engine.scheduler.schedule = step, schedule
        gc.callbacks.remove(on_gc)
    return runs


def host_profile(engine, prompts, params, top: int = 30) -> str:
    """cProfile of one cold run of the load (unsynced): the host's functions by own time."""
    import cProfile
    import io
    import pstats
    engine.update_weights([])
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def step_phases(engine, prompts, params, slow_factor: float = 2.5) -> dict:
    """One cold run (unsynced) with the host time of each decode step's parts: the steps slower than `slow_factor`
    times the median, part by part, beside the median step's parts."""
    from lathe.engine import cuda_graph
    graphs = engine.runner.graphs
    from lathe.device import Staging
    copies = ([(cuda_graph, "to_device")] if hasattr(cuda_graph, "to_device")      # the graphs' host-to-device copies
              else [(Staging, "writable"), (Staging, "copy_to")])                  # (before 4a16dac: to_device)
    targets = [(engine.scheduler, "schedule"), (engine, "_resolve"), (llm_engine._InFlight, "add_placeholders"),
               (llm_engine._InFlight, "__init__"), (graphs, "_sync_tables"), *copies,
               (engine.kv_cache, "copy_blocks"), (engine.runner, "decode")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    cur: dict = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    for obj, name, fn in saved:
        setattr(obj, name, timed(name, fn))
    step, steps = engine.step, []

    def t_step():
        cur.clear()
        t = time.perf_counter()
        n = step()
        steps.append({"wall": time.perf_counter() - t, **cur})
        return n

    engine.step = t_step
    try:
        engine.update_weights([])
        torch.cuda.synchronize()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    finally:
        engine.step = step
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    decode = [(i, s) for i, s in enumerate(steps) if "decode" in s]
    walls = sorted(s["wall"] for _, s in decode)
    median = walls[len(walls) // 2]
    ms = lambda s: {k: round(v * 1e3, 3) for k, v in s.items()}          # noqa: E731
    mid = next(s for _, s in decode if s["wall"] == median)
    return {"median_step": ms(mid), "slow_steps": [{"step": i, **ms(s)} for i, s in decode
                                                     if s["wall"] > slow_factor * median]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--batched-tokens", default="8192", help="engine step token budgets to run the load at")
    ap.add_argument("--repeats", type=int, default=4, help="unsynced cold runs, each step timed")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {**result_header("step_probe", device, args), "models": {}}
    for name in args.models.split(","):
        engine, prompts, params = fixed_load_engine(name, device, args)
        default_budget = engine.scheduler.max_num_batched_tokens
        for _ in range(2):
            engine.update_weights([])
            engine.generate(prompts, params)
        unsynced = []                                   # (budget, runs), in the order run
        for budget in map(int, args.batched_tokens.split(",")):
            engine.scheduler.max_num_batched_tokens = budget
            unsynced.append((budget, unsynced_steps(engine, prompts, params, args.repeats)))
            for r in unsynced[-1][1]:
                print(name, budget, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                     if k != "slow_decode_steps"}, flush=True)
        engine.scheduler.max_num_batched_tokens = default_budget
        phases = [step_phases(engine, prompts, params) for _ in range(args.repeats)]
        for p in phases:
            print(name, "median", p["median_step"], flush=True)
            for row in p["slow_steps"][:12]:
                print("   slow", row, flush=True)
        host = host_profile(engine, prompts, params)
        print(host[:6000], flush=True)
        rows = timed_prefills(engine, prompts, params)
        res["models"][name] = {"unsynced_runs": unsynced, "decode_step_phases": phases, "host_profile": host, "prefill_steps": rows,
                               "profile": profiled_prefill(engine, prompts, params)}
        print(name, [{k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
              flush=True)
        engine.sleep()
        del engine
        torch.cuda.empty_cache()
    write_result(res, args.out)


if __name__ == "__main__":
    main()
