import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import deque

from lathe.reward.workers import Worker


def _state(pid: int) -> str | None:
    """Process state letter from /proc (None when gone); 'Z' is a dead, unreaped process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if _state(pid) in (None, "Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _run(worker: Worker, items: list[dict]) -> list:
    raw = [None] * len(items)
    worker.send(list(range(len(items))), items)
    while worker.pending:
        worker.conn.poll(5.0)
        worker.drain(raw)
    return raw


def test_worker_scores_a_chunk_in_order_then_dies_on_kill():
    worker = Worker(lambda ds, s, gt, extra_info=None: float(s == gt), "exact")
    items = [{"data_source": "d", "solution_str": s, "ground_truth": "a"} for s in "abca"]
    raw = _run(worker, items)
    assert [r[0] for r in raw] == [1.0, 0.0, 0.0, 1.0]
    assert worker.pending == deque()
    pid = worker.pid
    worker.kill()
    worker.kill()  # idempotent
    assert _state(pid) is None  # reaped, not a zombie


def test_kill_takes_the_scorers_own_child_processes_with_it(tmp_path):
    pid_file = tmp_path / "grandchild.pid"

    def spawn_and_hang(ds, s, gt, extra_info=None):
        child = subprocess.Popen(["sleep", "300"])
        pid_file.write_text(str(child.pid))
        time.sleep(300)

    worker = Worker(spawn_and_hang, "spawn_and_hang")
    worker.send([0], [{"data_source": "d", "solution_str": "x", "ground_truth": "y"}])
    deadline = time.monotonic() + 5
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the scorer never started its child process"
        time.sleep(0.02)
    grandchild = int(pid_file.read_text())
    assert _state(grandchild) not in (None, "Z")
    worker.kill()
    assert _wait_dead(grandchild, within_s=2.0)


def test_worker_kills_itself_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from lathe.reward.workers import Worker
        def hang(*args, **kwargs):
            time.sleep(300)
        w = Worker(hang, "hang")
        w.send([0], [{"data_source": "d", "solution_str": "x", "ground_truth": "y"}])
        print(w.pid, flush=True)
        time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        assert _state(worker_pid) not in (None, "Z")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _wait_dead(worker_pid, within_s=4.0)


def test_a_forked_copy_never_kills_its_siblings():
    worker = Worker(lambda *a, **k: 1.0, "one")
    pid = os.fork()
    if pid == 0:  # child: its copy of `worker` must be inert
        worker.kill()
        os._exit(0)
    os.waitpid(pid, 0)
    assert _state(worker.pid) not in (None, "Z")
    worker.kill()
    assert _state(worker.pid) is None
