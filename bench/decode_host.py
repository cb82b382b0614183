"""Is the engine's decode host-bound? Each `LatheEngine.generate` call timed step by step: the host's busy time (a
step's wall time less its wait for the previous step's tokens) and its parts (scheduling, resolving the previous
step's tokens, the placeholders, the graph's input staging and launch), the device's time in each decode graph and
the device's idle gap before the next one (CUDA events around the staging and replay).

    python bench/decode_host.py [--model 0.5b] [--out FILE]        # the engine alone, e2e's rollout shape
    python bench/decode_host.py --train FILE train base key=value ...   # inside `lathe train` (bench/e2e.py's command)

The first form builds random bf16 weights of a bench/common.py shape and generates 32 prompts of 256 tokens x 8
samples, 512 new tokens each (ignore_eos), three calls; the second runs the lathe command in this process with every
generate call instrumented (its rows in FILE, one per call). `--cprofile` adds a fourth call whose engine steps run
under Python's profiler: the functions the host spends the call's steps in, by own time an engine step (its
`host_profile`; nearly all steps are decode steps; the profiler slows the host, so that call's other figures are not
comparable with the first three).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, build_hf, device_name, git_sha, random_prompts  # noqa: E402

from lathe.engine import llm_engine  # noqa: E402


def instrument(profile: dict | None = None) -> list[dict]:
    """Wrap `LatheEngine.generate` (and, during a call, the engine's step and graph replay); returns the list each
    call's row is appended to. While `profile["on"]` is true, each call's steps run under a `cProfile.Profile` and
    its row gets `host_profile` (`profile_rows`)."""
    calls, cur = [], {}
    generate = llm_engine.LatheEngine.generate

    def timed(fn, key):
        def wrapped(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            cur[key] = cur.get(key, 0.0) + time.perf_counter() - start
            return out
        return wrapped

    def timed_generate(engine, *args, **kwargs):
        graphs, events, steps = engine.runner.graphs, [], []
        run, step = graphs.run, engine.step
        schedule, resolve = engine.scheduler.schedule, engine._resolve
        placeholders = llm_engine._InFlight.add_placeholders
        engine.scheduler.schedule, engine._resolve = timed(schedule, "schedule"), timed(resolve, "resolve")
        llm_engine._InFlight.add_placeholders = timed(placeholders, "placeholders")

        def timed_run(*a, **k):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            out = run(*a, **k)
            end.record()
            cur["staging_and_launch"] = time.perf_counter() - start
            events.append((begin, end))
            return out

        def timed_step():     # (the wait for the previous step's tokens: the engine's own `device_wait_s`)
            cur.clear()
            n, waited, start = len(events), engine.device_wait_s, time.perf_counter()
            if profiler is not None:
                profiler.enable()
            out = step()
            if profiler is not None:
                profiler.disable()
            steps.append(dict(cur, wall=time.perf_counter() - start, wait=engine.device_wait_s - waited,
                              graph=len(events) > n))
            return out
        profiler = cProfile.Profile() if profile and profile.get("on") else None
        graphs.run, engine.step = timed_run, timed_step
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            out = generate(engine, *args, **kwargs)
            torch.cuda.synchronize()
        finally:
            graphs.run, engine.step, engine.scheduler.schedule, engine._resolve = run, step, schedule, resolve
            llm_engine._InFlight.add_placeholders = placeholders
        calls.append(summarize(time.perf_counter() - start, steps, events))
        if profiler is not None:
            calls[-1]["host_profile"] = profile_rows(profiler, len(steps))
        print("decode_host", json.dumps(calls[-1]), flush=True)
        return out
    llm_engine.LatheEngine.generate = timed_generate
    return calls


def summarize(wall: float, steps: list[dict], events: list) -> dict:
    busy = [b.elapsed_time(e) / 1e3 for b, e in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) / 1e3 for i in range(len(events) - 1)]
    decode = [s for s in steps if s["graph"]]
    host = [s["wall"] - s.get("wait", 0.0) for s in decode]
    ms = lambda xs: {q: float(np.percentile(xs, q)) * 1e3 for q in (10, 50, 90, 99)} if xs else {}  # noqa: E731
    return {"wall_s": wall, "decode_steps": len(decode),
            "other_steps_s": sum(s["wall"] for s in steps if not s["graph"]),
            "device_graph_s": sum(busy), "device_gap_s": sum(gaps), "gaps_over_100us": sum(g > 1e-4 for g in gaps),
            "largest_gaps_ms": [g * 1e3 for g in sorted(gaps)[-8:]], "device_step_ms": ms(busy),
            "host_busy_ms": ms(host), "host_wait_s": sum(s.get("wait", 0.0) for s in decode),
            # the host's mean per decode step in each part (`resolve` less its wait for the device)
            "host_sections_ms": {key: float(np.mean([s.get(key, 0.0) - (s.get("wait", 0.0) if key == "resolve" else 0)
                                                     for s in decode])) * 1e3 if decode else None
                                 for key in ("schedule", "resolve", "placeholders", "staging_and_launch")}}


def profile_rows(profiler: cProfile.Profile, steps: int, top: int = 25) -> list[dict]:
    """The `top` functions by own time under `profiler`, each with its own and cumulative time and its calls per step
    (over `steps` steps)."""
    import pstats
    stats = pstats.Stats(profiler).stats
    rows = [{"function": f"{Path(file).name}:{line}({name})", "own_ms_per_step": tt / steps * 1e3,
             "cumulative_ms_per_step": ct / steps * 1e3, "calls_per_step": nc / steps}
            for (file, line, name), (_, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top]


def engine_alone(name: str, cprofile: bool = False) -> list[dict]:
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation.sampling import SamplingParams
    from lathe.models.hf import lathe_from_transformers
    model = lathe_from_transformers(build_hf(name, torch.device("cuda"), torch.bfloat16).eval(), clone=True).eval()
    torch.cuda.empty_cache()
    vocab = SHAPES[name]["vocab_size"]
    engine = LatheEngine(model, eos_token_id=vocab - 1, max_num_seqs=256, gpu_memory_utilization=0.5)
    prompts = random_prompts(32, 256, 256, vocab, 0)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, seed=0)
    profile = {"on": False}
    calls = instrument(profile)
    for _ in range(3):
        engine.generate(prompts, params)
    if cprofile:
        profile["on"] = True
        engine.generate(prompts, params)
    return calls


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--train":
        out, argv = Path(sys.argv[2]), sys.argv[3:]
        calls = instrument()
        from lathe.cli import main as lathe
        code = lathe(argv)
        out.write_text(json.dumps({"calls": calls}, indent=1))
        sys.exit(code)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b")
    p.add_argument("--out", type=Path)
    p.add_argument("--cprofile", action="store_true", help="a fourth call under Python's profiler (module doc)")
    args = p.parse_args()
    result = {"device": device_name(torch.device("cuda")), "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "git_sha": git_sha(), "model": args.model, "calls": engine_alone(args.model, args.cprofile)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
