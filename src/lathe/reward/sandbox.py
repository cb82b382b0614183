"""Running untrusted programs (the responses of code tasks) in a local sandbox.

Isolation comes from the OS, not from Python: each run is a `bwrap` (bubblewrap) process with every namespace
unshared (no network, its own PIDs, IPC and hostname), an empty environment, a read-only `/usr`, a private
`/tmp`, and one writable directory of its own, deleted afterwards. It runs as an unprivileged user (`nobody`
when lathe runs as root) under resource limits set before `bwrap` starts: address space (`memory_limit_mb`),
CPU seconds, processes of that user (a fork bomb stops there), output file size (a 1 GB print is cut and the
program killed), no core files. A wall-clock limit kills the whole process tree; when the program's first
process ends, the kernel ends every other process of its PID namespace, so nothing outlives a run. At most
`max_concurrent` runs at once across every scoring process (slots are `flock`ed files).

With `reward_model.sandbox_fusion.url` (verl's key) the programs go to that SandboxFusion service instead.

The programs run with the system's `/usr/bin/python3` (stdlib only), not lathe's environment. Run as a normal
user, the process limit is that user's current process count plus `max_processes` (the kernel counts them all).
"""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
SLOTS_DIR = Path(tempfile.gettempdir()) / "lathe-sandbox-slots"


class SandboxUnavailable(RuntimeError):
    """The local sandbox cannot run here (bubblewrap missing, or user namespaces disabled)."""


@dataclass
class RunResult:
    status: str            # "ok" (exit 0), "error" (non-zero exit or killed by a limit), "timeout", "output_limit"
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float


@dataclass
class SandboxLimits:
    time_limit_s: float = 5.0
    memory_limit_mb: int = 1024
    max_output_bytes: int = 1 << 20
    max_processes: int = 64
    max_concurrent: int = 4
    url: str | None = None          # a SandboxFusion service's run_code endpoint instead of the local sandbox


_LIMITS = SandboxLimits()


def configure(**limits) -> SandboxLimits:
    """Set the process-wide limits (`lathe train` does it from `reward_model.sandbox_fusion.*` before scoring
    processes fork)."""
    global _LIMITS
    _LIMITS = SandboxLimits(**{**vars(_LIMITS), **limits})
    return _LIMITS


def unavailable() -> str | None:
    """Why the local sandbox cannot run here, or None (always None with a service URL: it is tried per run)."""
    if _LIMITS.url:
        return None
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed; install the OS package (Debian/Ubuntu: apt-get install bubblewrap)"
    if not Path("/usr/bin/python3").exists():
        return "/usr/bin/python3 is missing (sandboxed programs run with the system's Python)"
    probe = run_python("print(1)", limits=SandboxLimits(time_limit_s=10, max_concurrent=1000), check=False)
    if probe.status != "ok" or probe.stdout.strip() != "1":
        return f"bubblewrap cannot start a sandbox here ({probe.stderr.strip()[:200] or probe.status})"
    return None


def run_python(code: str, stdin: str = "", *, limits: SandboxLimits | None = None, check: bool = True) -> RunResult:
    """Run `code` (a Python program) on `stdin` in a fresh sandbox; its stdout, stderr and how it ended."""
    limits = limits or _LIMITS
    if limits.url:
        with _slot(limits.max_concurrent):
            return run_remote(limits.url, code, stdin, limits)
    if check and shutil.which("bwrap") is None:
        raise SandboxUnavailable(unavailable() or "bubblewrap is not installed")
    work = Path(tempfile.mkdtemp(prefix="lathe-sbx-"))
    try:
        (work / "main.py").write_text(code)
        if os.geteuid() == 0:
            os.chown(work, NOBODY, NOBODY)
            os.chown(work / "main.py", NOBODY, NOBODY)
        with _slot(limits.max_concurrent):
            return _run(work, stdin, limits)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_remote(url: str, code: str, stdin: str, limits: SandboxLimits) -> RunResult:
    """The same run on a SandboxFusion service (`POST url` with its run_code request). A service that cannot be
    reached or answers garbage raises `SandboxUnavailable`: the reward manager counts it as the sample's error,
    and an outage stops the run (`reward.max_failing_calls`) instead of scoring everything 0."""
    import json
    import urllib.error
    import urllib.request
    body = json.dumps({"code": code, "language": "python", "stdin": stdin, "compile_timeout": 10,
                       "run_timeout": limits.time_limit_s, "memory_limit_MB": limits.memory_limit_mb}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=limits.time_limit_s + 30) as response:
            answer = json.loads(response.read())
        run = answer.get("run_result") or {}
        service, state, code_ = answer.get("status"), run.get("status"), run.get("return_code")
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        raise SandboxUnavailable(f"reward_model.sandbox_fusion.url={url}: {e}") from None
    if service == "SandboxError":
        raise SandboxUnavailable(f"reward_model.sandbox_fusion.url={url}: the service failed ({answer})"[:300])
    status = "timeout" if state == "TimeLimitExceeded" else "ok" if state == "Finished" and code_ == 0 else "error"
    return RunResult(status, str(run.get("stdout") or "")[:limits.max_output_bytes],
                     str(run.get("stderr") or "")[:limits.max_output_bytes], code_, time.monotonic() - start)


def _command(work: Path) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8",
           "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):
        p = Path("/") / name
        if p.is_symlink():
            cmd += ["--symlink", os.readlink(p), f"/{name}"]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), f"/{name}"]
    return cmd + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(work), "/sandbox",
                  "--chdir", "/sandbox", "--", "/usr/bin/python3", "-I", "-B", "main.py"]


def _limits_in_child(limits: SandboxLimits):
    def apply() -> None:
        memory = limits.memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = int(limits.time_limit_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_output_bytes, limits.max_output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() == 0:            # root ignores RLIMIT_NPROC: run as nobody
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            nproc = limits.max_processes
        else:                            # the limit counts all of this user's processes: allow that many more
            nproc = _processes_of(os.getuid()) + limits.max_processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    return apply


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _run(work: Path, stdin: str, limits: SandboxLimits) -> RunResult:
    out_path, err_path = work.parent / f"{work.name}.out", work.parent / f"{work.name}.err"
    start = time.monotonic()
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(_command(work), stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    preexec_fn=_limits_in_child(limits), start_new_session=True)
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=limits.time_limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:          # the program exited without reading its input
                pass
            finally:
                _kill_tree(proc)
        stdout, stderr = _read(out_path, limits.max_output_bytes), _read(err_path, limits.max_output_bytes)
        over = max(out_path.stat().st_size, err_path.stat().st_size) >= limits.max_output_bytes
    finally:
        out_path.unlink(missing_ok=True)
        err_path.unlink(missing_ok=True)
    code = proc.returncode
    status = ("timeout" if timed_out else "output_limit" if over or code == -signal.SIGXFSZ
              else "ok" if code == 0 else "error")
    return RunResult(status, stdout, stderr, code, time.monotonic() - start)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's session; its PID namespace (and everything in it) goes with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


@contextmanager
def _slot(max_concurrent: int):
    """One of `max_concurrent` slots shared by every process on this machine (flock'ed files)."""
    SLOTS_DIR.mkdir(parents=True, exist_ok=True)
    while True:
        for i in range(max(1, max_concurrent)):
            f = open(SLOTS_DIR / f"slot{i}", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(0.01)
