"""verl's `global_profiler` with `tool=torch`: a PyTorch profiler trace of each listed training step, and a summary
of where the step's time went, phase by phase.

    global_profiler.tool=torch global_profiler.steps=[3,4] global_profiler.save_path=outputs/profile
    global_profiler.with_stack=true         # lathe: Python frames too (`python_function` events; slower)

writes, for each listed step N (verl's step numbers: the first step is 1),

- `<save_path>/step_N/trace.json.gz`: the Chrome trace (open in ui.perfetto.dev or chrome://tracing); every timed
  phase of the step (`gen`, `reward`, `update_actor`, ... the `timing_s/*` names) is a range `timing/<phase>` in it;
- `<save_path>/step_N/summary.json`: per phase, its wall seconds, the device seconds of the kernels launched during
  it (from any thread: the backward pass launches from autograd's; a CUDA graph replay counts all its kernels),
  those seconds by kind (matmul, attention, other) and the top kernels; on a CPU run, the top operators by their
  own host time.

The profiler covers the trainer process: on one device, the whole step. Ray workers (several devices, a rollout
pool of its own, `LATHE_RAY=1`) run in other processes, which it does not reach; `config.rules` refuses the
combination up front and `StepProfiler` again at run time. A profiled step is slower than the others (the profiler
records every operator and kernel): its `timing_s/*` metrics say so, not the steps around it.
"""

from __future__ import annotations

import gzip
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from lathe import device as accel

__all__ = ["PHASE_PREFIX", "StepProfiler", "device_phases", "host_phases", "kernel_kind"]

PHASE_PREFIX = "timing/"      # the profiler range of a timed phase: `timing/<phase>` (lathe.track.timer)
TOP = 15                      # kernels (or host operators) listed per phase


def kernel_kind(name: str) -> str:
    """matmul, attention or other, from a device kernel's name (cuBLAS/CUTLASS/nvjet GEMMs; flash, cuDNN SDPA,
    lathe's paged decode kernel)."""
    low = name.lower()
    if any(s in low for s in ("flash", "fmha", "sdpa", "attention", "_decode_kernel", "attn")):
        return "attention"
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "_mm_", "mm_kernel", "sm90_")):
        return "matmul"
    return "other"


def _descendants(event) -> Iterator:
    stack = list(event.cpu_children)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.cpu_children)


def _top(tally: dict[str, list[float]], key: str) -> list[dict]:
    rows = sorted(tally.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [{"name": n[:160], key: s, "calls": c} for n, (s, c) in rows]


def host_phases(events) -> dict[str, dict]:
    """{phase: {wall_s, top_host_ops}} from a finished CPU-only profiler's `events()`: the operators run inside each
    `timing/<phase>` range, by their own host time. A phase timed twice in the step (DAPO's rounds) adds up."""
    phases: dict[str, dict] = {}
    tallies: dict[str, dict[str, list[float]]] = {}
    for event in events:
        if not event.name.startswith(PHASE_PREFIX):
            continue
        name = event.name[len(PHASE_PREFIX):]
        entry = phases.setdefault(name, {"wall_s": 0.0})
        entry["wall_s"] += event.time_range.elapsed_us() / 1e6
        tally = tallies.setdefault(name, {})
        for e in _descendants(event):
            row = tally.setdefault(e.name, [0.0, 0])
            row[0] += e.self_cpu_time_total / 1e6
            row[1] += 1
    for name, entry in phases.items():
        entry["top_host_ops"] = _top(tallies[name], "self_s")
    return phases


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")       # cudaLaunchKernel, cudaGraphLaunch, cuLaunchKernel ...
NO_PHASE = "(outside the timed phases)"


def device_phases(trace: dict) -> dict[str, dict]:
    """{phase: {wall_s, device_s, device_busy_fraction, kinds, top}} from a Chrome trace of a CUDA run.

    A device kernel (or copy) belongs to the phase during which the host launched it, on whichever thread: the
    backward pass launches from autograd's own thread, a CUDA graph replay launches all the graph's kernels at once,
    and kernels run after the launching code returned. A launch inside nested phases counts for the innermost;
    one outside every phase goes to "(outside the timed phases)"."""
    events = trace.get("traceEvents", [])
    windows = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(PHASE_PREFIX):]) for e in events
                      if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PHASE_PREFIX)),
                     key=lambda w: w[1] - w[0])                      # innermost (shortest) first
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    walls: dict[str, float] = {}
    for start, end, name in windows:
        walls[name] = walls.get(name, 0.0) + (end - start) / 1e6
    tallies: dict[str, dict[str, list[float]]] = {name: {} for name in walls}
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        t = launched.get(e.get("args", {}).get("correlation"))
        phase = next((name for start, end, name in windows if t is not None and start <= t <= end), NO_PHASE)
        row = tallies.setdefault(phase, {}).setdefault(e.get("name", "?"), [0.0, 0])
        row[0] += e.get("dur", 0) / 1e6
        row[1] += 1
    out = {}
    for name, tally in tallies.items():
        total = sum(s for s, _ in tally.values())
        kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for kernel, (s, _) in tally.items():
            kinds[kernel_kind(kernel)] += s
        wall = walls.get(name)
        out[name] = {"wall_s": wall, "device_s": total, "device_busy_fraction": total / wall if wall else None,
                     "kinds": kinds, "top": _top(tally, "s")}
    return out


class StepProfiler:
    """Profiles the steps in `steps` (a `with profiler.step(n):` around each training step) and writes their trace
    and summary under `save_path`. `tool`: None (off) or "torch"."""

    def __init__(self, tool: str | None, steps: list[int] | None, save_path: str | Path,
                 device: torch.device, *, remote_workers: bool = False, with_stack: bool = False):
        self.steps = set(steps or []) if tool == "torch" else set()
        if tool not in (None, "torch"):
            raise ValueError(f"global_profiler.tool={tool!r}: lathe profiles with tool=torch only")
        if self.steps and remote_workers:
            raise ValueError("global_profiler.tool=torch profiles the trainer process, but this run's training and "
                             "rollout happen in Ray workers (several devices, a rollout pool, or LATHE_RAY=1) that it "
                             "does not reach. Fix: profile a one-device run, or remove global_profiler.tool")
        self.save_path = Path(save_path)
        self.device = torch.device(device)
        self.with_stack = with_stack            # Python frames too (`python_function` events in the trace)
        self.written: list[Path] = []

    def _device_name(self) -> str:
        if self.device.type != "cuda":
            return self.device.type
        index = self.device.index if self.device.index is not None else accel.current_device("cuda").index
        return accel.properties(index, "cuda")["name"]

    def enabled(self, step: int) -> bool:
        return step in self.steps

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile the `with` body when `step` is listed; on exit write `step_<step>/{trace.json.gz,summary.json}`."""
        if not self.enabled(step):
            yield
            return
        from torch.profiler import ProfilerActivity, profile
        device = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
        start = time.perf_counter()
        with profile(activities=activities, with_stack=self.with_stack) as prof:
            yield
            accel.synchronize(self.device)
        wall = time.perf_counter() - start
        out = self.save_path / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / "trace.json.gz"
        prof.export_chrome_trace(str(trace))
        phases = device_phases(json.loads(gzip.decompress(trace.read_bytes()))) if device else host_phases(prof.events())
        summary = {"step": step, "device": self._device_name(),
                   "wall_s": wall, "phases": phases,
                   "note": "a profiled step runs slower than an unprofiled one; compare phases within it"}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.written.append(out)
        print(f"lathe: profile of step {step} written to {out} (trace.json.gz, summary.json)", flush=True)
