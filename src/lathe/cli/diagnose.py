"""`lathe diagnose`: what this machine has, checked against what lathe needs (verl's `scripts/diagnose.py`).

    lathe diagnose             # the report, then every problem with what to change; exit 1 when a check fails
    lathe diagnose --json      # the same as one JSON object ({"facts": ..., "checks": [...]})
    lathe diagnose --ray       # also join the Ray cluster (RAY_ADDRESS, or the local one) and list its resources

Facts come from a `Probe` (this machine; tests pass a fake one); checks are plain functions of the facts. The
known-good ranges are lathe's own requirements (its installed metadata: pyproject.toml's), plus what multi-GPU
runs need from the environment: visible-device variables that agree, network interfaces that exist, enough
shared memory and open files.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

GIB = 1024 ** 3
# what the report lists beside lathe's own requirements (imported only to read a version when no metadata says):
# the optional packages and what each adds ...
OPTIONAL = {"ray": "many devices, fully async", "triton": "GPU kernels", "wandb": "trainer.logger=wandb",
            "mlflow": "trainer.logger=mlflow", "hypothesis": "the test suite", "peft": "the test suite",
            "flash-linear-attention": "Qwen3.5 / Qwen3-Next / Nemotron-H kernels on GPUs: lathe[hybrid]"}
# ... and other frameworks' packages, named only when installed: lathe has its own engine and attention kernels
OTHERS = ("flash-attn", "vllm", "sglang")
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME",
            "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE",
            "NCCL_DEBUG", "RAY_ADDRESS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
            "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_OFFLINE")
MIN_SHM = GIB                 # NCCL and Ray's object store live in /dev/shm (Docker's default is 64 MB)
MIN_OPEN_FILES = 65536        # Ray opens a socket per worker and connection


@dataclass
class Check:
    name: str
    status: str               # "ok", "warn" or "fail"
    detail: str
    fix: str = ""


class Probe:
    """Reads this machine. Every method answers plainly (None or empty where there is nothing to read)."""

    def python(self) -> dict:
        return {"version": platform.python_version(), "executable": sys.executable}

    def system(self) -> dict:
        mem = _meminfo()
        return {"os": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "cpu_model": _cpu_model(), "memory_gb": mem.get("MemTotal", 0) / GIB,
                "memory_available_gb": mem.get("MemAvailable", 0) / GIB}

    def requirements(self) -> list[str]:
        """lathe's own dependency specifiers (`name>=x`), extras left out: from its installed metadata, or the
        source tree's pyproject.toml when it runs from a checkout (PYTHONPATH=src)."""
        try:
            return [r for r in metadata.requires("lathe") or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            return list(_pyproject().get("dependencies", []))

    def requires_python(self) -> str | None:
        try:
            return metadata.metadata("lathe").get("Requires-Python")
        except metadata.PackageNotFoundError:
            return _pyproject().get("requires-python")

    def version(self, name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
        try:                                         # e.g. a package put on PYTHONPATH without its metadata
            module = __import__(name.replace("-", "_"))
        except Exception:                            # noqa: BLE001 - missing or broken: reported as missing
            return None
        return getattr(module, "__version__", "unknown")

    def torch(self) -> dict:
        import torch

        from lathe import device
        platform = device.detect()
        out = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
               "platform": platform.name, "cuda_available": platform.device_type != "cpu", "cudnn": None,
               "nccl": device.collectives_version(), "gpus": []}
        if out["cuda_available"]:
            out["cudnn"] = torch.backends.cudnn.version()
            for i in range(device.device_count()):
                p = device.properties(i)
                out["gpus"].append({"index": i, "name": p["name"], "memory_gb": p["total_memory"] / GIB,
                                    "capability": p["capability"]})
        return out

    def gpus_present(self) -> int:
        """GPUs the driver exposes, whatever the visible-devices variables say."""
        from lathe.config.rules import _gpus_present
        return _gpus_present()

    def driver(self) -> str | None:
        text = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if text:
            return text.splitlines()[0].strip()
        if os.path.exists("/sys/module/amdgpu/version"):
            return "amdgpu " + open("/sys/module/amdgpu/version").read().strip()
        return None

    def interfaces(self) -> list[str]:
        return sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []

    def infiniband(self) -> list[str]:
        return sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []

    def shm_bytes(self) -> int | None:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return None
        return st.f_blocks * st.f_frsize

    def open_files(self) -> int | None:
        try:
            import resource
        except ImportError:
            return None
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None if soft == resource.RLIM_INFINITY else soft

    def cpu(self) -> dict:
        """Cores and the 1-minute load average (how busy the machine is now)."""
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return {"cores": os.cpu_count() or 1, "load1": load}

    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in ENV_KEYS if k in os.environ}

    def ray(self, connect: bool) -> dict:
        out: dict[str, Any] = {"address": os.environ.get("RAY_ADDRESS"),
                               "local_cluster": os.path.exists("/tmp/ray/ray_current_cluster")}
        if not connect:
            return out
        try:
            import ray
            ray.init(address=out["address"] or "auto", include_dashboard=False, logging_level="ERROR")
            out["resources"] = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
            out["nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
            ray.shutdown()
        except Exception as e:                       # noqa: BLE001 - reported: no cluster, or Ray missing
            out["error"] = f"{type(e).__name__}: {e}"
        return out


def collect(probe: Probe, *, ray: bool = False) -> dict:
    names = [_req_name(r) for r in probe.requirements()]
    return {"python": probe.python(), "system": probe.system(), "requires_python": probe.requires_python(),
            "requirements": probe.requirements(),
            "packages": {n: probe.version(n) for n in dict.fromkeys([*names, *OPTIONAL, *OTHERS])},
            "torch": probe.torch(), "gpus_present": probe.gpus_present(), "driver": probe.driver(),
            "interfaces": probe.interfaces(), "infiniband": probe.infiniband(), "shm_bytes": probe.shm_bytes(),
            "open_files": probe.open_files(), "cpu": probe.cpu(), "env": probe.env(), "ray": probe.ray(connect=ray)}


# -- checks ---------------------------------------------------------------------------------------------------
def check(facts: dict) -> list[Check]:
    return [*_check_versions(facts), *_check_accelerator(facts), *_check_visible_devices(facts),
            *_check_network(facts), *_check_limits(facts), *_check_threads(facts), *_check_ray(facts)]


def _check_versions(f: dict) -> list[Check]:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    out = []
    spec = f.get("requires_python")
    if spec:
        ok = f["python"]["version"] in SpecifierSet(spec)
        out.append(Check("python", "ok" if ok else "fail", f"Python {f['python']['version']} (lathe needs {spec})",
                         "" if ok else f"use a Python {spec} interpreter"))
    for text in f["requirements"]:
        req = Requirement(text)
        have = f["packages"].get(req.name)
        if have is None:
            out.append(Check(req.name, "fail", f"{req.name} is not installed (lathe needs {req})",
                             f"pip install '{req}'"))
        elif have != "unknown" and req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(Check(req.name, "fail", f"{req.name} {have} is outside lathe's range {req.specifier}",
                             f"pip install '{req}'"))
        else:
            out.append(Check(req.name, "ok", f"{req.name} {have}"))
    if f["packages"].get("ray") is None:
        out.append(Check("ray", "warn", "Ray is not installed: one device only (no multi-GPU, no fully-async "
                                        "training)", "pip install 'lathe[ray]'"))
    return out


def _check_accelerator(f: dict) -> list[Check]:
    t, present = f["torch"], f["gpus_present"]
    out = []
    if t["cuda"] is None and t["hip"] is None:
        status = "warn" if present else "ok"
        out.append(Check("torch build", status, f"torch {t['version']} is a CPU build" + (
            f", but the driver shows {present} GPU(s)" if present else ""),
            "install a CUDA (or ROCm) build of torch matching the driver" if present else ""))
        return out
    build = f"CUDA {t['cuda']}" if t["cuda"] else f"ROCm/HIP {t['hip']}"
    if not t["cuda_available"]:
        status = "fail" if present else "warn"
        out.append(Check("accelerator", status, f"torch {t['version']} ({build}) sees no GPU" + (
            f" while the driver shows {present}" if present else ""),
            "check the driver against the torch build (nvidia-smi's 'CUDA Version' must be at least the build's), "
            "and CUDA_VISIBLE_DEVICES" if present else "none needed for a CPU run"))
        return out
    gpus = t["gpus"]
    out.append(Check("accelerator", "ok", f"torch {t['version']} ({build}, NCCL/RCCL {t['nccl']}), "
                                          f"{len(gpus)} GPU(s): " + ", ".join(
                                              f"{g['name']} {g['memory_gb']:.0f} GiB sm{g['capability']}"
                                              for g in gpus) + f"; driver {f['driver']}"))
    old = [g for g in gpus if float(g["capability"]) < 8.0 and t["cuda"]]
    if old:
        out.append(Check("bf16", "warn", f"GPU {old[0]['name']} (compute capability {old[0]['capability']}) has no "
                                         "bf16 tensor cores: lathe's mixed precision is bf16",
                         "use Ampere (sm80) or newer, or set actor_rollout_ref.rollout.dtype=float16 and "
                         "fsdp_config.mixed_precision.param_dtype=fp16"))
    if t["cuda"] and f["packages"].get("triton") is None and f["system"]["machine"] == "x86_64":
        out.append(Check("triton", "warn", "triton is missing: the engine's paged decode kernel falls back to PyTorch "
                                           "and torch.compile does not run", "pip install triton (the version "
                                                                             "torch was built with)"))
    out += _check_fla(f, gpus)
    return out


def _check_fla(f: dict, gpus: list[dict]) -> list[Check]:
    """fla refuses its gated delta-rule backward on Hopper with Triton 3.4 .. 3.7.0 (`lathe.models.linear_attention`
    says what lathe does then)."""
    from packaging.version import InvalidVersion, Version
    fla, triton = f["packages"].get("flash-linear-attention"), f["packages"].get("triton")
    hopper = [g for g in gpus if str(g["capability"]).startswith("9.")]
    try:
        broken = triton is not None and (3, 4, 0) <= Version(triton).release[:3] < (3, 7, 1)
    except InvalidVersion:
        broken = False
    if not (fla and hopper and broken):
        return []
    return [Check("fla backward", "warn", f"triton {triton} on {hopper[0]['name']}: fla {fla} refuses its gated "
                  "delta-rule and Mamba2-scan backwards here (fla issue 640), so training Qwen3.5 / Qwen3-Next / "
                  "Nemotron-H runs them only for key heads (Mamba2: states) wider than 64, once a check of each head "
                  "layout against lathe's torch form passes, and narrower ones (or a failed layout) on the torch "
                  "form, several times slower",
                  "a torch build whose triton is 3.7.1 or newer lifts this")]


def _visible(value: str | None) -> list[str] | None:
    return None if value is None else [e.strip() for e in value.split(",") if e.strip()]


def _check_visible_devices(f: dict) -> list[Check]:
    env, present, out = f["env"], f["gpus_present"], []
    cuda, hip, rocr = (_visible(env.get(k)) for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                       "ROCR_VISIBLE_DEVICES"))
    if cuda is not None and cuda[:1] != ["-1"]:
        bad = [e for e in cuda if present and not (e.isdigit() and int(e) < present or e.startswith(("GPU-", "MIG-")))]
        if bad:
            out.append(Check("CUDA_VISIBLE_DEVICES", "fail", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                             f"names {', '.join(bad)}, but the machine has GPUs 0-{present - 1}",
                             "list existing GPU indices (or UUIDs), or unset it"))
        if len(set(cuda)) != len(cuda):
            out.append(Check("CUDA_VISIBLE_DEVICES", "fail", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                             "lists a GPU twice (two ranks would share it; NCCL refuses)", "list each GPU once"))
    if hip is not None and cuda is not None and hip != cuda:
        out.append(Check("HIP_VISIBLE_DEVICES", "fail", f"HIP_VISIBLE_DEVICES={env['HIP_VISIBLE_DEVICES']} and "
                         f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} differ: ROCm's torch reads both",
                         "set both to the same list, or unset one"))
    if rocr is not None and (hip is not None or cuda is not None):
        out.append(Check("ROCR_VISIBLE_DEVICES", "fail", f"ROCR_VISIBLE_DEVICES={env['ROCR_VISIBLE_DEVICES']} is set "
                         "beside HIP/CUDA_VISIBLE_DEVICES: ROCR renumbers the devices first, so Ray's per-worker "
                         "HIP/CUDA ids point at other GPUs", "unset ROCR_VISIBLE_DEVICES (select GPUs with "
                                                             "HIP_VISIBLE_DEVICES only)"))
    if not out and any(v is not None for v in (cuda, hip, rocr)):
        shown = ", ".join(f"{k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                    "ROCR_VISIBLE_DEVICES") if k in env)
        out.append(Check("visible devices", "ok", shown))
    return out


def _check_network(f: dict) -> list[Check]:
    env, have, out = f["env"], set(f["interfaces"]), []
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if key not in env:
            continue
        names = [n.strip() for n in env[key].split(",") if n.strip()]
        wanted = [n for n in names if not n.startswith("^")]       # ^eth excludes; =eth0 is an exact name
        missing = [n for n in wanted if not any(i == n.lstrip("=") or (not n.startswith("=") and i.startswith(n))
                                                 for i in have)]
        if missing:
            out.append(Check(key, "fail", f"{key}={env[key]}: no interface {' or '.join(missing)} on this machine "
                             f"(it has {', '.join(sorted(have)) or 'none'})", "name an interface the nodes share "
                                                                              "(e.g. the one `ip route` uses), "
                                                                              "or unset it"))
        else:
            out.append(Check(key, "ok", f"{key}={env[key]}"))
    if env.get("NCCL_IB_HCA") and not f["infiniband"]:
        out.append(Check("NCCL_IB_HCA", "warn", f"NCCL_IB_HCA={env['NCCL_IB_HCA']} but no InfiniBand device is "
                         "present", "unset it (NCCL then uses sockets), or check the IB driver"))
    if env.get("NCCL_IB_DISABLE") == "1" and f["infiniband"]:
        out.append(Check("NCCL_IB_DISABLE", "warn", f"NCCL_IB_DISABLE=1 on a machine with InfiniBand "
                         f"({', '.join(f['infiniband'])}): traffic between nodes goes over sockets",
                         "unset NCCL_IB_DISABLE for multi-node runs"))
    return out


def _check_limits(f: dict) -> list[Check]:
    out = []
    shm = f["shm_bytes"]
    if shm is not None and shm < MIN_SHM:
        out.append(Check("/dev/shm", "warn", f"/dev/shm holds {shm / 2**20:.0f} MiB: NCCL and Ray's object store "
                         "need more", "run the container with --shm-size=16g (or --ipc=host)"))
    files = f["open_files"]
    if files is not None and files < MIN_OPEN_FILES:
        out.append(Check("open files", "warn", f"ulimit -n is {files}: Ray may run out of file descriptors with "
                         "many workers", f"ulimit -n {MIN_OPEN_FILES} (or more) before starting Ray"))
    return out


def _check_threads(f: dict) -> list[Check]:
    """CPU threads that would compete with other processes: an OpenMP pool told to spin, or a busy machine where torch
    would start one thread per core for a large CPU model (a small one trains on one thread: `device.cpu_threads`)."""
    env, cpu = f["env"], f.get("cpu") or {}
    out = []
    if env.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
        out.append(Check("cpu threads", "warn", "OMP_WAIT_POLICY=ACTIVE: idle OpenMP threads spin, taking cores from "
                         "every other process", "unset OMP_WAIT_POLICY, or set it to PASSIVE on a shared machine"))
    load, cores = cpu.get("load1"), cpu.get("cores", 1)
    if load is not None and load >= 0.5 * cores and "OMP_NUM_THREADS" not in env:
        out.append(Check("cpu threads", "warn", f"this machine is busy (load {load:.1f} on {cores} cores): torch's "
                         "default of one thread per core makes a CPU run wait on threads that are not scheduled "
                         "(lathe uses one thread for models under 50M parameters on its own)",
                         f"OMP_NUM_THREADS={max(1, cores // 2)} (or fewer) for a larger model trained on the CPU"))
    return out


def _check_ray(f: dict) -> list[Check]:
    r = f["ray"]
    if "error" in r:
        return [Check("ray cluster", "warn", f"could not join Ray at {r['address'] or 'auto'}: {r['error']}",
                      "start one (ray start --head) or set RAY_ADDRESS; without one lathe starts its own")]
    if "resources" in r:
        return [Check("ray cluster", "ok", f"{r['nodes']} node(s), " + ", ".join(
            f"{k} {v:g}" for k, v in sorted(r["resources"].items()) if k in ("CPU", "GPU", "memory")))]
    return []


# -- the report -----------------------------------------------------------------------------------------------
def report(facts: dict, checks: list[Check]) -> str:
    s, t = facts["system"], facts["torch"]
    lines = [f"python     {facts['python']['version']} ({facts['python']['executable']})",
             f"system     {s['os']}, {s['cpus']} CPUs ({s['cpu_model'] or s['machine']}), "
             f"{s['memory_gb']:.1f} GiB RAM ({s['memory_available_gb']:.1f} free)",
             f"torch      {t['version']} (CUDA {t['cuda']}, HIP {t['hip']}, cuDNN {t['cudnn']}, NCCL {t['nccl']})"]
    lines += [f"gpu {g['index']}      {g['name']}, {g['memory_gb']:.1f} GiB, sm{g['capability']}" for g in t["gpus"]]
    lines += _package_lines(facts["packages"])
    if facts["env"]:
        lines.append("env        " + " ".join(f"{k}={v}" for k, v in facts["env"].items()))
    lines.append("")
    for c in checks:
        mark = {"ok": "  ok  ", "warn": " WARN ", "fail": " FAIL "}[c.status]
        lines.append(f"[{mark}] {c.name}: {c.detail}" + (f"\n         fix: {c.fix}" if c.fix and c.status != "ok"
                                                          else ""))
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    lines.append(f"\n{failed} problem(s), {warned} warning(s)")
    return "\n".join(lines)


def _package_lines(packages: dict[str, str | None]) -> list[str]:
    """Installed packages; the optional ones not installed, with what each would add; other frameworks' packages
    only when installed, saying lathe does not use them. (A missing requirement is a failed check below.)"""
    lines = ["packages   " + ", ".join(f"{k} {v}" for k, v in packages.items() if v and k not in OTHERS)]
    required = [k for k, v in packages.items() if not v and k not in OPTIONAL and k not in OTHERS]
    if required:
        lines.append("missing    " + ", ".join(required) + " (required)")
    optional = [f"{k} ({why})" for k, why in OPTIONAL.items() if not packages.get(k)]
    if optional:
        lines.append("optional   not installed, lathe runs without them: " + ", ".join(optional))
    others = [f"{k} {packages[k]}" for k in OTHERS if packages.get(k)]
    if others:
        lines.append("unused     " + ", ".join(others) + " (other frameworks': lathe does not need them)")
    return lines


def run(*, as_json: bool = False, ray: bool = False, probe: Probe | None = None, out=None) -> int:
    """Print the report (or JSON); 1 when a check failed, else 0."""
    facts = collect(probe or Probe(), ray=ray)
    checks = check(facts)
    out = out or sys.stdout
    if as_json:
        out.write(json.dumps({"facts": facts, "checks": [asdict(c) for c in checks]}, indent=2, default=str) + "\n")
    else:
        out.write(report(facts, checks) + "\n")
    return 1 if any(c.status == "fail" for c in checks) else 0


def _pyproject() -> dict:
    """The [project] table of the checkout this module runs from ({} when there is none)."""
    import tomllib
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        return tomllib.loads(path.read_text()).get("project", {})
    except (OSError, ValueError):
        return {}


def _req_name(text: str) -> str:
    return re.split(r"[\s<>=!~;\[]", text, maxsplit=1)[0]


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in open("/proc/meminfo"):
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cpu_model() -> str | None:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
