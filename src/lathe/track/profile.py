"""verl's `global_profiler` with `tool=torch`: a PyTorch profiler trace of each listed training step, and a summary
of where the step's time went, phase by phase.

    global_profiler.tool=torch global_profiler.steps=[3,4] global_profiler.save_path=outputs/profile
    global_profiler.with_stack=true         # lathe: Python frames too (`python_function` events; slower)

writes, for each listed step N (verl's step numbers: the first step is 1),

- `<save_path>/step_N/trace.json.gz`: the Chrome trace (open in ui.perfetto.dev or chrome://tracing); every timed
  phase of the step (`gen`, `reward`, `update_actor`, ... the `timing_s/*` names) is a range `timing/<phase>` in it;
- `<save_path>/step_N/summary.json`: per phase, its wall seconds, the device seconds of the kernels launched during
  it (from any thread: the backward pass launches from autograd's; a CUDA graph replay counts all its kernels),
  those seconds by kind (matmul, attention, other) and by a finer class (`kernel_class`), and the top kernels; on
  a CPU run, the top operators by their own host time.

On one device the trainer process runs the whole step. With Ray workers (several devices, `LATHE_RAY=1`) each
rank is profiled too, in its own process, for the same step: `<save_path>/step_N/<group>_rank<R>/` holds that
rank's trace and summary, its phases the worker calls the driver made (`actor_rollout_ref.update_actor`, ...), and
`step_N/summary.json` lists every rank's phases beside the driver's. The fully-async loop (two pools running
freely, no step boundary in the rollout pool) is not profiled; `config.rules` refuses it. A profiled step is slower
than the others (the profiler records every operator and kernel): its `timing_s/*` metrics say so, not the steps
around it. `tool=torch_memory` (a CUDA memory snapshot of each listed step, per rank) runs through the same
`StepProfiler`; lathe.track.memory_history says what it writes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from lathe import device as accel
from lathe.config.profiler import MemoryHistorySettings
from lathe.track.memory_history import MemoryHistory, snapshot_name

log = logging.getLogger(__name__)

__all__ = ["CLASSES", "PHASE_PREFIX", "StepProfiler", "device_phases", "finish", "host_phases", "kernel_class",
           "kernel_kind", "start"]

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


CLASSES = ("matmul", "attention_fwd", "attention_bwd", "softmax_vocab", "fused_elementwise", "elementwise",
           "reduce", "optimizer", "copy", "communication", "other")


def kernel_class(name: str) -> str:
    """A finer cut than `kernel_kind`, for an update's profile (issue 48's classes): matmul; attention forward or
    backward; softmax / log-softmax / logsumexp kernels (the log-prob and entropy over the vocabulary; Inductor's
    that compute exp, amax or log); Inductor's other fused kernels (`triton_*`: norms, activations, RoPE); eager
    elementwise and reduction kernels; the optimizer's (multi-tensor / foreach / Adam); copies and fills; NCCL."""
    low = name.lower()
    kind = kernel_kind(name)
    if kind == "attention":
        return "attention_bwd" if any(s in low for s in ("bwd", "backward", "dq", "dkdv", "dk_dv")) else "attention_fwd"
    if kind == "matmul":
        return "matmul"
    if low.startswith("triton_") and {"exp", "amax", "log", "logsumexp", "softmax"} & set(low.split("_")):
        return "softmax_vocab"          # Inductor's fused log-softmax / entropy (its kernels are named by their ops)
    rules = (("communication", ("nccl",)),
             ("optimizer", ("multi_tensor", "foreach", "adam")),     # (not "lamb": most eager kernels name a lambda)
             ("softmax_vocab", ("softmax", "logsumexp", "log_prob", "logprob", "entropy", "cross_entropy")),
             ("fused_elementwise", ("triton_",)),
             ("copy", ("memcpy", "memset", "copy", "catarray", "fill", "index", "scatter", "gather")),
             ("reduce", ("reduce",)),
             ("elementwise", ("elementwise", "vectorized", "unrolled")))
    return next((cls for cls, marks in rules if any(m in low for m in marks)), "other")


def _descendants(event) -> Iterator:
    stack = list(event.cpu_children)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.cpu_children)


def _top(tally: dict[str, list[float]], key: str, top: int = TOP) -> list[dict]:
    rows = sorted(tally.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n[:160], key: s, "calls": c} for n, (s, c) in rows]


def host_phases(trace: dict) -> dict[str, dict]:
    """{phase: {wall_s, top_host_ops}} from a Chrome trace of a CPU run: the operators run inside each
    `timing/<phase>` range on its thread, by their own host time (their callees' taken out), and the named ranges
    inside it (`Optimizer.step#AdamW.step`) by theirs. A phase timed twice in the step (DAPO's rounds) adds up; an
    operator inside nested phases counts for each. (Read from the trace, as
    `device_phases` is: the profiler's own event tree, `prof.events()`, took 5 s to build for a step of a tiny model.)"""
    events = trace.get("traceEvents", [])
    windows = [((e.get("pid"), e.get("tid")), e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(PHASE_PREFIX):])
               for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    phases: dict[str, dict] = {}
    tallies: dict[str, dict[str, list[float]]] = {}
    for _, start, end, name in windows:
        phases.setdefault(name, {"wall_s": 0.0})["wall_s"] += (end - start) / 1e6
        tallies.setdefault(name, {})
    for thread, ts, op, own in _host_self_times(events, (*HOST_CATEGORIES, "user_annotation")):
        for where, start, end, name in windows:
            if where == thread and start <= ts <= end and not op.startswith(PHASE_PREFIX):
                row = tallies[name].setdefault(op, [0.0, 0])
                row[0] += own / 1e6
                row[1] += 1
    for name, entry in phases.items():
        entry["top_host_ops"] = _top(tallies[name], "self_s")
    return phases


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")       # cudaLaunchKernel, cudaGraphLaunch, cuLaunchKernel ...
NO_PHASE = "(outside the timed phases)"


def device_phases(trace: dict, top: int = TOP) -> dict[str, dict]:
    """{phase: {wall_s, device_s, device_busy_fraction, kinds, top, host_top}} from a Chrome trace of a CUDA run
    (`top`: the longest kernels and host operators listed, of each).

    A device kernel (or copy) belongs to the phase during which the host launched it, on whichever thread: the
    backward pass launches from autograd's own thread, a CUDA graph replay launches all the graph's kernels at once,
    and kernels run after the launching code returned. A launch inside nested phases counts for the innermost;
    one outside every phase goes to "(outside the timed phases)". `host_top`: the host operators and CUDA API calls
    that started in the phase, by their own time (their callees' taken out), on any thread: where the host spends a
    phase the device waits through (a `cudaStreamSynchronize` is a sync point, an `aten::` op's own time dispatch)."""
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
    host: dict[str, dict[str, list[float]]] = {}
    for _, ts, op, own in _host_self_times(events):
        phase = next((name for start, end, name in windows if start <= ts <= end), None)
        if phase is not None:
            row = host.setdefault(phase, {}).setdefault(op, [0.0, 0])
            row[0] += own / 1e6
            row[1] += 1
    out = {}
    for name, tally in tallies.items():
        total = sum(s for s, _ in tally.values())
        kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        classes = dict.fromkeys(CLASSES, 0.0)
        for kernel, (s, _) in tally.items():
            cls = kernel_class(kernel)          # (a refinement of kernel_kind: the kind follows from the class)
            classes[cls] += s
            kinds["matmul" if cls == "matmul" else "attention" if cls.startswith("attention") else "other"] += s
        wall = walls.get(name)
        out[name] = {"wall_s": wall, "device_s": total, "device_busy_fraction": total / wall if wall else None,
                     "kinds": kinds, "classes": classes, "top": _top(tally, "s", top),
                     "host_top": _top(host.get(name, {}), "self_s", top)}
    return out


HOST_CATEGORIES = ("cpu_op", "python_function", *LAUNCH_CATEGORIES)


def _host_self_times(events: list[dict], categories: tuple = HOST_CATEGORIES) -> Iterator[tuple[tuple, float, str,
                                                                                                float]]:
    """((pid, tid), start, name, own microseconds) of each host event of `categories`: its duration less its
    children's on the same thread. An event directly inside one of its own name (an operator redispatched to
    itself) is one call with it, as in torch's `prof.events()`."""
    by_thread: dict = {}
    for e in events:
        if e.get("cat") in categories and e.get("ph") == "X":
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for key, thread in by_thread.items():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []              # [end, start, name, own, duration, merged] of the open events
        for e in thread:
            start, dur, name = e["ts"], e.get("dur", 0), e["name"]
            while stack and stack[-1][0] <= start:
                yield from _close(key, stack)
            merged = bool(stack) and stack[-1][2] == name
            if stack and not merged:
                stack[-1][3] -= dur
            stack.append([start + dur, start, name, dur, dur, merged])
        while stack:
            yield from _close(key, stack)


def _close(key: tuple, stack: list[list]) -> Iterator[tuple[tuple, float, str, float]]:
    """Pop the innermost open event: yield it, or (merged into its parent) take its children's time off the parent."""
    _, start, name, own, dur, merged = stack.pop()
    if merged:
        stack[-1][3] -= dur - own
    else:
        yield key, start, name, own


def start(device: torch.device, *, with_stack: bool = False):
    """A started torch profiler of this process (CPU operators, and the device's kernels on CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities, with_stack=with_stack)
    prof.start()
    return prof


def finish(prof, device: torch.device, out: Path, *, wall: float | None = None, **extra) -> dict:
    """Stop `prof` (after the device's queued work), write `out/trace.json.gz` and `out/summary.json` (the phases:
    `device_phases` on CUDA, `host_phases` on a CPU, plus `extra`) and return the summary."""
    accel.synchronize(device)
    prof.stop()
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))        # written by the profiler itself (torch's own .gz path writes it line by
    text = raw.read_bytes()                   # line through Python's gzip at level 9: a second a step on a CPU)
    with gzip.open(out / "trace.json.gz", "wb", compresslevel=6) as f:
        f.write(text)
    raw.unlink()
    trace = json.loads(text)
    phases = device_phases(trace) if device.type == "cuda" else host_phases(trace)
    summary = {"device": _device_name(device), "wall_s": wall, "phases": phases, **extra}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else accel.current_device("cuda").index
    return accel.properties(index, "cuda")["name"]


class StepProfiler:
    """Profiles the steps in `steps` (a `with profiler.step(n):` around each training step) and writes their files
    under `save_path`. `tool`: None (off), "torch" (a trace and summary) or "torch_memory" (a CUDA memory snapshot per
    rank, `memory`: its settings; lathe.track.memory_history). `workers`: the Ray worker groups whose ranks are
    profiled for the same steps (each a `lathe.cluster.worker_group.RayWorkerGroup`)."""

    def __init__(self, tool: str | None, steps: list[int] | None, save_path: str | Path,
                 device: torch.device, *, workers: list | tuple = (), with_stack: bool = False,
                 memory: MemoryHistorySettings | None = None):
        if tool not in (None, "torch", "torch_memory"):
            raise ValueError(f"global_profiler.tool={tool!r}: lathe profiles with tool=torch or torch_memory only")
        self.tool = tool
        self.device = torch.device(device)
        self.steps = set(steps or []) if tool else set()
        if tool == "torch_memory":
            self.steps = self._memory_steps(steps)
        self.save_path = Path(save_path)
        self.workers = list(workers)
        self.with_stack = with_stack            # Python frames too (`python_function` events in the trace)
        self.memory = memory or MemoryHistorySettings()
        self.written: list[Path] = []

    def _memory_steps(self, steps: list[int] | None) -> set[int]:
        if self.device.type != "cuda":
            log.warning("global_profiler.tool=torch_memory records the CUDA allocator's history, but this run trains "
                        "on %s (trainer.device=auto found no GPU): no memory snapshot is written", self.device.type)
            return set()
        if not steps:
            log.warning("global_profiler.tool=torch_memory with no global_profiler.steps: the memory of step 1 is "
                        "recorded (set global_profiler.steps=[N,...] to choose)")
        return set(steps or [1])

    def enabled(self, step: int) -> bool:
        return step in self.steps

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile the `with` body when `step` is listed (and every worker rank for the same step); on exit write
        `step_<step>/{trace.json.gz,summary.json}` (and each rank's under `step_<step>/<group>_rank<R>/`), or with
        torch_memory each rank's snapshot in `step_<step>/`."""
        if not self.enabled(step):
            yield
            return
        out = self.save_path / f"step_{step}"
        if self.tool == "torch_memory":
            with self._memory_step(step, out):
                yield
            return
        for group in self.workers:
            group.host_call("profile_start", self.with_stack)
        start_time = time.perf_counter()
        prof = start(self.device, with_stack=self.with_stack)
        try:
            yield
        except BaseException:
            prof.stop()                 # the run is failing: no summary (the ranks' profilers end with them)
            raise
        wall = time.perf_counter() - start_time
        ranks = {}
        for group in self.workers:              # each rank writes its own files; the summaries come back
            answers = group.host_call("profile_stop", str(out))
            ranks.update({f"{group.name}_rank{r}": a for r, a in enumerate(answers)})
        finish(prof, self.device, out, wall=wall, step=step, ranks=ranks,
               note="a profiled step runs slower than an unprofiled one; compare phases within it")
        self.written.append(out)
        where = f", and each rank's under {out}/<group>_rank<R>" if ranks else ""
        print(f"lathe: profile of step {step} written to {out} (trace.json.gz, summary.json{where})", flush=True)

    @contextmanager
    def _memory_step(self, step: int, out: Path) -> Iterator[None]:
        """Record the allocator's history on every trainer rank (the Ray ranks, else this process) through the body;
        each rank then writes its snapshot into `out` and stops recording."""
        settings = dataclasses.asdict(self.memory)
        own = None if self.workers else MemoryHistory(self.device, self.memory)
        for group in self.workers:
            group.host_call("memory_history_start", settings)
        if own is not None:
            own.start()
        try:
            yield
        except BaseException:
            if own is not None:
                own.stop()              # the run is failing: no snapshot (the ranks' recording ends with them)
            raise
        paths = [own.dump(out / snapshot_name(0))] if own is not None else []
        for group in self.workers:
            paths += [Path(p) for p in group.host_call("memory_history_dump", str(out))]
        self.written.append(out)
        print(f"lathe: memory snapshot of step {step} written to {out} ({', '.join(p.name for p in paths)}; "
              f"open in https://pytorch.org/memory_viz)", flush=True)
