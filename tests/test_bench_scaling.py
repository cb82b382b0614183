"""bench/scaling.py: its arms, the ratios each from the same call, the profiled arm, and an arm past the budget or
failed left out of the ratios. The bench runs in a child process with bench/ on its path (as when it runs), its
e2e.py children stubbed by a `run_child` that writes what e2e.py would."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import scaling
STEP = {"g1": 6.0, "g2": 4.0, "g4": 3.0, "g2w": 6.5}          # g4w fails: no JSON
commands = []

def run_child(cmd, log, timeout):
    commands.append(cmd)
    out = Path(cmd[cmd.index("--out") + 1])
    name = out.stem
    if name in STEP:
        s = STEP[name]
        phases = {"gen": s / 4, "ref": s / 4, "update_actor": s / 2, "update_weights": 0.01}
        out.write_text(json.dumps({"device": "X", "torch": "t", "models": {"1.5b": {"lathe": {
            "step_s": s, "phases_s": phases}}}}))
        return 0, 1.0
    return 1, 1.0

scaling.run_child = run_child
scaling.main(["--gpus", "1,2,4", "--profile-step", "3", "--workdir", sys.argv[2] + "/w", "--git-sha", "abc",
              "--out", sys.argv[2] + "/out.json", "--extra", "a=1"])
print(json.dumps({"commands": commands}))
try:
    scaling.arms([2, 4], 32, True)
except SystemExit as e:
    print(json.dumps({"refused": str(e)}))
"""


def test_scaling_runs_each_arm_and_takes_each_ratio_from_this_call(tmp_path):
    done = subprocess.run([sys.executable, "-c", STUB, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    commands = json.loads(lines[-2])["commands"]
    assert "from 1" in json.loads(lines[-1])["refused"]
    names = [Path(c[c.index("--out") + 1]).stem for c in commands]
    assert names == ["g1", "g2", "g4", "g2w", "g4w"]
    gpus_prompts = [(c[c.index("--gpus") + 1], c[c.index("--prompts") + 1]) for c in commands]
    assert gpus_prompts == [("1", "32"), ("2", "32"), ("4", "32"), ("2", "64"), ("4", "128")]
    assert [("--profile-step" in c) for c in commands] == [False, False, True, False, False]   # the widest strong arm
    assert all(c[-2:] == ["--extra", "a=1"] for c in commands)
    got = json.loads((tmp_path / "out.json").read_text())
    s = got["summary"]
    assert s["strong_speedup_2"] == 1.5 and s["strong_speedup_4"] == 2.0
    assert s["weak_efficiency_2"] == round(6.0 / 6.5, 3) and "weak_efficiency_4" not in s     # g4w failed
    assert s["phase_strong_speedup_4"] == {"gen": 2.0, "ref": 2.0, "update_actor": 2.0}
    assert got["arms"]["g4w"]["returncode"] == 1 and "g4w" not in got["runs"]
    assert got["git_sha"] == "abc" and "4 GPUs same batch 3.00 s (2.00x)" in got["what"]


BUDGET = """
import sys
sys.path.insert(0, sys.argv[1])
import scaling
ran, clock = [], [0.0]


class Clock:                    # each arm takes the whole of its limit
    monotonic = staticmethod(lambda: clock[0])


def run_child(cmd, log, timeout):
    ran.append(timeout)
    clock[0] += timeout
    return 124, timeout


scaling.time, scaling.run_child = Clock, run_child
scaling.main(["--gpus", "1,2", "--budget", "150", "--arm-min", "100", "--timeout", "300",
              "--workdir", sys.argv[2] + "/w", "--out", sys.argv[2] + "/out.json"])
print(ran)
"""


def test_an_arm_starts_only_with_time_left_in_the_budget(tmp_path):
    """The first arm runs under what is left of --budget (not --timeout); the stub takes all of it, so the others are
    recorded as skipped, not started."""
    done = subprocess.run([sys.executable, "-c", BUDGET, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    limits = json.loads(done.stdout.strip().splitlines()[-1])
    assert limits == [145]
    arms = json.loads((tmp_path / "out.json").read_text())["arms"]
    assert "skipped" in arms["g2"] and "skipped" in arms["g2w"]


PROFILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import common
rank = lambda gen, ref: {"phases": {"actor_rollout_ref.generate_sequences": {"wall_s": gen},
                                    "actor_rollout_ref.compute_ref_log_prob": {"wall_s": ref}}}
profile = {"phases": {"gen": {"wall_s": 1.4}, "ref": {"wall_s": 0.5}, "adv": {"wall_s": 0.02}},
           "ranks": {"r0": rank(1.1, 0.3), "r1": rank(1.2, 0.25)}}
print(json.dumps(common.driver_over_ranks(profile)))
"""


def test_a_profiled_step_gives_the_drivers_seconds_above_the_slowest_rank(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROFILE, str(ROOT / "bench")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(got) == {"gen", "ref"}                              # (adv runs on the driver only)
    assert got["gen"]["slowest_rank_s"] == 1.2 and abs(got["gen"]["over_s"] - 0.2) < 1e-9
    assert abs(got["ref"]["over_s"] - 0.2) < 1e-9
