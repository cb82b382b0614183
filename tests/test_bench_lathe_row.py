"""bench/common.lathe_row: a run's metrics.jsonl steps into one result row (medians over the timed steps), with the
device's energy and power per phase where the run measured them (`lathe.track.energy`). In a child process, as the
benches import it (bench/ first on the path)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import common

def step(s, watts, energy=True):
    row = {"timing_s/step": s, "timing_s/gen": s / 3, "perf/throughput": 1000 / s}
    if energy:
        row.update({"perf/energy_j/step": watts * s, "perf/power_w/step": watts, "perf/power_limit_w": 700.0})
    return row

with_energy = common.lathe_row([step(9.0, 300), step(6.0, 690), step(6.2, 700), step(6.1, 680)], warmup=1,
                               flops=0.0, peak_tflops=None)
without = common.lathe_row([step(6.0, 0, energy=False)] * 3, warmup=1, flops=0.0, peak_tflops=None)
print(json.dumps([with_energy, without]))
"""


def rows_of(child: str) -> list:
    """The rows a child script prints last, as JSON."""
    done = subprocess.run([sys.executable, "-c", child, str(ROOT / "bench")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_medians_energy_and_power_by_phase():
    row, without = rows_of(CHILD)
    assert row["step_s"] == pytest.approx(6.1) and row["phases_s"]["gen"] == pytest.approx(6.1 / 3)
    assert row["power_w_by_phase"] == {"step": 690} and row["power_limit_w"] == 700.0
    assert row["energy_j_by_phase"]["step"] == pytest.approx(6.1 * 680)   # the median of each metric
    assert not {"power_w_by_phase", "energy_j_by_phase", "power_limit_w"} & set(without)


KL_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import common

steps = [{"timing_s/step": 6.0, "actor/kl_loss": k} for k in (0.04, 0.041, 0.039)]
with_kl = common.lathe_row(steps, warmup=1, flops=0.0, peak_tflops=None)
without = common.lathe_row([{"timing_s/step": 6.0}] * 3, warmup=1, flops=0.0, peak_tflops=None)
print(json.dumps([with_kl, without]))
"""


def test_the_kl_loss_is_kept_step_by_step_warm_up_included():
    """A quantised reference's gap is step 1's KL (actor = reference there), which the medians leave out."""
    with_kl, without = rows_of(KL_CHILD)
    assert with_kl["consistency"]["kl_loss_all"] == [0.04, 0.041, 0.039]
    assert "kl_loss_all" not in without["consistency"]


MFU_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import common

steps = [{"timing_s/step": 6.0, "timing_s/update_actor": 4.0}] * 3
both = common.lathe_row(steps, warmup=1, flops=2e15, peak_tflops=1000.0, matmul_rate=800e12)
datasheet = common.lathe_row(steps, warmup=1, flops=2e15, peak_tflops=1000.0)
print(json.dumps([both, datasheet]))
"""


def test_the_update_mfu_over_the_datasheet_peak_and_over_the_measured_matmul_rate():
    """Issue 48 asks for the update's MFU of the measured matmul rate; `update_mfu` is over the datasheet's peak."""
    both, datasheet = rows_of(MFU_CHILD)
    assert both["update_mfu"] == pytest.approx(0.5) == datasheet["update_mfu"]
    assert both["update_mfu_measured_rate"] == pytest.approx(2e15 / 4.0 / 800e12)
    assert "update_mfu_measured_rate" not in datasheet
