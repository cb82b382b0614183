"""The probe behind bench/results/decode_host_fast_host_0.5b_nvidia-h200.json, as it ran at e1ce75a (from an
untracked folder; kept here for the record and removed in the next commit: bench/decode_host.py is its kept form).

`lathe train` with every LatheEngine.generate call instrumented (host busy, wait, device graph time and gaps per
decode step), to see what the trainer's rollout loses against the engine alone (host_probe.py).
    python bench/decode_host_train_probe.py OUT.json train base key=value ..."""
import atexit, gc, json, sys, time
import numpy as np
import torch
sys.path.insert(0, "src")
from lathe.engine import llm_engine as le

out_path = sys.argv.pop(1)
calls = []
cur = {}
to_host = le._InFlight.to_host


def to_host_w(self):
    t = time.perf_counter()
    if self.event is not None:
        self.event.synchronize()
    cur["wait"] = cur.get("wait", 0.0) + time.perf_counter() - t
    return to_host(self)


le._InFlight.to_host = to_host_w
generate = le.LatheEngine.generate


def generate_w(self, *a, **k):
    graphs = self.runner.graphs
    events, steps, gcs = [], [], []
    run, step = graphs.run, self.step

    def run_w(*ra, **rk):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        s.record()
        r = run(*ra, **rk)
        e.record()
        cur["graph_run_host"] = time.perf_counter() - t
        events.append((s, e))
        return r

    def step_w():
        cur.clear()
        n0 = len(events)
        t = time.perf_counter()
        r = step()
        steps.append(dict(cur, wall=time.perf_counter() - t, graph=len(events) > n0))
        return r
    cb = lambda phase, info: gcs.append((phase, time.perf_counter()))  # noqa: E731
    gc.callbacks.append(cb)
    graphs.run, self.step = run_w, step_w
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        res = generate(self, *a, **k)
        torch.cuda.synchronize()
    finally:
        graphs.run, self.step = run, step
        gc.callbacks.remove(cb)
    wall = time.perf_counter() - t0
    t_first = steps and steps[0]["wall"]
    dev_busy = [s.elapsed_time(e) / 1e3 for s, e in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) / 1e3 for i in range(len(events) - 1)]
    dec = [s for s in steps if s["graph"]]
    host = [s["wall"] - s.get("wait", 0.0) for s in dec]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else None  # noqa: E731
    calls.append({"wall_s": wall, "steps": len(steps), "decode_steps": len(dec), "gc_events": len(gcs) // 2,
                  "first_step_s": t_first, "steps_wall_s": sum(s["wall"] for s in steps),
                  "device_graph_s": sum(dev_busy), "device_gap_s": sum(gaps),
                  "gaps_over_100us": sum(1 for g in gaps if g > 1e-4),
                  "gap_top_ms": [g * 1e3 for g in sorted(gaps)[-8:]],
                  "dev_step_ms": {q: pct(dev_busy, q) for q in (10, 50, 90, 99)},
                  "host_busy_ms": {q: pct(host, q) for q in (10, 50, 90, 99)},
                  "wait_sum_s": sum(s.get("wait", 0.0) for s in dec),
                  "graph_run_host_ms_mean": float(np.mean([s.get("graph_run_host", 0) for s in dec])) * 1e3,
                  "non_decode_steps_s": sum(s["wall"] for s in steps if not s["graph"])})
    print("PROBE", json.dumps(calls[-1])[:800], flush=True)
    return res


le.LatheEngine.generate = generate_w
atexit.register(lambda: json.dump(calls, open(out_path, "w"), indent=1))
from lathe.cli import main  # noqa: E402
code = main(sys.argv[1:])
json.dump(calls, open(out_path, "w"), indent=1)
sys.exit(code)
