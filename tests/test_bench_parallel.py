"""bench/parallel.py: one-GPU bench commands side by side, one GPU each (an A/B from one device call)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_arm_gets_its_gpu_and_the_worst_return_code_comes_back(tmp_path):
    arm = f"{sys.executable} -c \"import os, sys; print('gpu', os.environ['CUDA_VISIBLE_DEVICES']); sys.exit({{}})\""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel.py"), "--logs", str(tmp_path), "--gpus",
                           "3,5", arm.format(0), arm.format(2)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (tmp_path / "arm0.log").read_text().strip() == "gpu 3"
    assert (tmp_path / "arm1.log").read_text().strip() == "gpu 5"


def test_arms_never_share_a_bench_workdir(tmp_path):
    """Each arm has a temp dir of its own, so benches' default workdirs differ (a shared /tmp/lathe-e2e made two arms
    read one run's metrics); a bench given a workdir another one holds stops at once and names it."""
    arm = (f"{sys.executable} -c \"import sys; sys.path.insert(0, '{ROOT / 'bench'}'); import common; "
           "print(common.default_workdir('lathe-e2e'))\"")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel.py"), "--logs", str(tmp_path), arm, arm],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    dirs = [(tmp_path / f"arm{i}.log").read_text().strip().splitlines()[-1] for i in (0, 1)]
    assert len(set(dirs)) == 2 and all(Path(d).name == "lathe-e2e" and Path(d).parent.parent == tmp_path
                                       and Path(d).parent.name.startswith(f"bench-arm{i}-") for i, d in enumerate(dirs))

    hold = (f"{sys.executable} -c \"import sys, time; sys.path.insert(0, '{ROOT / 'bench'}'); import common; "
            f"from pathlib import Path; common.claim_workdir(Path('{tmp_path / 'w'}')); print('held', flush=True); "
            "time.sleep(60)\"")
    holder = subprocess.Popen(hold, shell=True, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(hold, shell=True, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "in use by another bench" in second.stderr, second.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_bench_claims_its_workdir_again_for_each_model(tmp_path):
    """bench/e2e.py and sft.py claim the workdir once per model of `--models` (default several): the process that holds
    it may claim it again (a second lock on a new descriptor would be refused by its own first one, ending the bench
    after its first model); another process still may not."""
    claim = (f"{sys.executable} -c \"import sys; sys.path.insert(0, '{ROOT / 'bench'}'); import common; "
             f"from pathlib import Path; w = Path('{tmp_path / 'w'}'); common.claim_workdir(w); "
             "common.claim_workdir(w); common.claim_workdir(w / '.' ); print('claimed', flush=True); "
             "sys.stdin.readline()\"")
    holder = subprocess.Popen(claim, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed", holder.stderr.read()
        other = subprocess.run(claim, shell=True, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert other.returncode != 0 and "in use by another bench" in other.stderr, other.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_sigterm_reaches_every_arm(tmp_path):
    """The call's own limit (SIGTERM) is passed on, so each arm's bench can still write what it measured."""
    import signal
    import time
    arm = (f"{sys.executable} -c \"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
           f"(open(sys.argv[1], 'w').write('wrote'), sys.exit(0))); time.sleep(60)\" {tmp_path}/{{}}.txt")
    runner = subprocess.Popen([sys.executable, str(ROOT / "bench" / "parallel.py"), "--logs", str(tmp_path),
                               arm.format("a"), arm.format("b")], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while runner.stdout.readline().startswith("arm0") is False and time.monotonic() < deadline:
            pass
        time.sleep(1.5)                                  # both arms are sleeping
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=30)
    finally:
        runner.kill()
    assert runner.returncode == 143
    assert (tmp_path / "a.txt").read_text() == "wrote" and (tmp_path / "b.txt").read_text() == "wrote"
