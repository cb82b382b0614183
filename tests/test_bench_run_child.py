"""bench/common.run_child under an outer `timeout`: a SIGTERM to the bench stops its child and lets the bench write
its JSON (a 7B A/B on the GPU machine was lost to a kill that came while its finished child exited), a second one
included (a child that ignores SIGTERM here: the bench waits its STOP_GRACE_S, 4 s here, then kills it)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BENCH = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import common
common.STOP_GRACE_S = 4.0
out, first_timeout = Path(sys.argv[2]), float(sys.argv[3])
(out.parent / "ready").write_text("")
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
rc, wall = common.run_child([sys.executable, "-c", stubborn], out.parent / "child.log", first_timeout)
again = time.perf_counter()
rc2, _ = common.run_child([sys.executable, "-c", "import time; time.sleep(120)"], out.parent / "child2.log", 300)
out.write_text(json.dumps({"rc": rc, "wall": wall, "rc2": rc2, "second_s": time.perf_counter() - again}))
"""


def bench_under_sigterms(tmp_path, first_timeout: float, signals_at: list[float]) -> dict:
    """Run BENCH (a child that ignores SIGTERM, given `first_timeout`, then a second child) and send the bench a
    SIGTERM at each of `signals_at` seconds after its first child started; the JSON it wrote."""
    out = tmp_path / "result.json"
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(ROOT / "bench"), str(out), str(first_timeout)],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        for at in signals_at:
            time.sleep(max(0.0, started + at - time.monotonic()))
            bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 0, err
    return json.loads(out.read_text())


def test_a_sigterm_stops_the_child_and_the_bench_still_writes(tmp_path):
    # at 1 s the child is running; it ignores the SIGTERM the bench passes on, so the bench waits to kill it, and
    # meanwhile (at 3 s) a second SIGTERM (what lost a run's JSON once) is ignored
    got = bench_under_sigterms(tmp_path, 300, [1.0, 3.0])
    assert got["rc"] == 143 and got["wall"] < 60                 # stopped, not waited out
    assert got["rc2"] == 143 and got["second_s"] < 1.0            # nothing more started after the SIGTERM


def test_a_sigterm_while_a_timed_out_child_stops_still_lets_the_bench_write(tmp_path):
    """The child outlives its own timeout (1 s) and ignores the bench's SIGTERM; the outer SIGTERM comes while the
    bench waits to kill it (at 3 s, within its 4 s stop: what lost a run's JSON): the stop goes on, the row says 124,
    nothing more starts."""
    got = bench_under_sigterms(tmp_path, 1.0, [3.0])
    assert got["rc"] == 124 and got["wall"] < 60
    assert got["rc2"] == 143 and got["second_s"] < 1.0
