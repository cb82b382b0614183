"""The probe behind bench/results/decode_host_fast_host_0.5b_nvidia-h200.json, as it ran at e1ce75a (from an
untracked folder; kept here for the record and removed in the next commit: bench/decode_host.py is its kept form).

Is the 0.5B decode host-bound on average or only by jitter? Per decode step: host busy (step wall minus the wait
for the previous step's tokens), the device's graph time and the device gap before it (CUDA events), host sections."""
import gc, json, os, statistics, sys, time
import numpy as np
import torch
sys.path.insert(0, "src"); sys.path.insert(0, "bench")
from common import build_hf, random_prompts, SHAPES
from lathe.engine import llm_engine as le
from lathe.engine.llm_engine import LatheEngine
from lathe.models.hf import lathe_from_transformers

name = sys.argv[1] if len(sys.argv) > 1 else "0.5b"
depth = os.environ.get("PROBE_TAG", "")
dev = torch.device("cuda")
hf = build_hf(name, dev, torch.bfloat16).eval()
model = lathe_from_transformers(hf, clone=True).eval()
del hf
torch.cuda.empty_cache()
shape = SHAPES[name]
engine = LatheEngine(model, eos_token_id=shape["vocab_size"] - 1, max_num_seqs=256, gpu_memory_utilization=0.5)
prompts = random_prompts(32, 256, 256, shape["vocab_size"], 0)
from lathe.generation.sampling import SamplingParams as SP
params = SP(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, seed=0)

rec = {"wait": 0.0, "sections": {}}
cur = {}


def timed(obj, attr, key):
    f = getattr(obj, attr)

    def w(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        cur[key] = cur.get(key, 0.0) + time.perf_counter() - t
        return r
    setattr(obj, attr, w)


to_host = le._InFlight.to_host


def to_host_w(self):
    t = time.perf_counter()
    if self.event is not None:
        self.event.synchronize()
    cur["wait"] = cur.get("wait", 0.0) + time.perf_counter() - t
    return to_host(self)


le._InFlight.to_host = to_host_w
timed(engine.scheduler, "schedule", "schedule")
timed(engine, "_resolve", "resolve_incl_wait")
timed(le._InFlight, "add_placeholders", "placeholders")
graphs = engine.runner.graphs
run = graphs.run
events = []


def run_w(*a, **k):
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    r = run(*a, **k)
    e.record()
    cur["graph_run_host"] = time.perf_counter() - t
    events.append((s, e))
    return r


graphs.run = run_w
step = engine.step
steps = []
gcs = []
gc.callbacks.append(lambda phase, info: gcs.append((phase, time.perf_counter(), info.get("generation"))))


def step_w():
    cur.clear()
    n0 = len(events)
    t = time.perf_counter()
    r = step()
    wall = time.perf_counter() - t
    steps.append(dict(cur, wall=wall, graph=len(events) > n0, t=t, batch=r))
    return r


engine.step = step_w
out = {"model": name, "tag": depth, "calls": []}
for call in range(3):
    steps.clear(); events.clear(); gcs.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    dev_busy = [s.elapsed_time(e) / 1e3 for s, e in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) / 1e3 for i in range(len(events) - 1)]
    dec = [s for s in steps if s["graph"]]
    host = [s["wall"] - s.get("wait", 0.0) for s in dec]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None
    row = {"wall_s": wall, "steps": len(steps), "decode_steps": len(dec), "gc_events": len(gcs),
           "device_graph_s": sum(dev_busy), "device_gap_s": sum(gaps),
           "gap_hist": {k: int(sum(1 for g in gaps if lo <= g < hi)) for k, lo, hi in
                        [("<20us", 0, 2e-5), ("<100us", 2e-5, 1e-4), ("<500us", 1e-4, 5e-4), (">=500us", 5e-4, 9)]},
           "gap_top": sorted(gaps)[-10:],
           "dev_step_ms": {q: pct(dev_busy, q) * 1e3 for q in (10, 50, 90, 99)},
           "host_busy_ms": {q: pct(host, q) * 1e3 for q in (10, 50, 90, 99)},
           "host_busy_sum_s": sum(host), "wait_sum_s": sum(s.get("wait", 0.0) for s in dec),
           "sections_ms_mean": {k: statistics.mean(s.get(k, 0.0) for s in dec) * 1e3
                                for k in ("schedule", "resolve_incl_wait", "wait", "placeholders", "graph_run_host")},
           "non_decode_steps_s": sum(s["wall"] for s in steps if not s["graph"]),
           }
    # which steps have the big gaps: is the step before a block boundary?
    big = [i for i, g in enumerate(gaps) if g > 1e-4]
    row["big_gap_steps"] = big[:40]
    row["host_busy_at_big_gaps_ms"] = [round((dec[i + 1]["wall"] - dec[i + 1].get("wait", 0)) * 1e3, 3)
                                       for i in big[:40] if i + 1 < len(dec)]
    out["calls"].append(row)
    print(json.dumps(row)[:1500], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"host_probe_{name}{depth}.json"), "w"), indent=1)
