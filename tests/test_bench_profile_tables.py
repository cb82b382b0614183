"""bench/profile_tables.py on a hand-made trace: every kernel listed with its class, and the device's idle time inside
each phase's span (overlapping kernels merged)."""

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_profile_tables", ROOT / "bench" / "profile_tables.py")
profile_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_tables)


def _trace() -> dict:
    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ph": "X", "tid": 1, "ts": ts, "dur": 2,
                "args": {"correlation": corr}}

    def kernel(ts, dur, corr, name):
        return {"cat": "kernel", "name": name, "ph": "X", "tid": 7, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    lam = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)::{lambda()#3}>"
    return {"traceEvents": [
        {"cat": "user_annotation", "name": "timing/update_actor", "ph": "X", "tid": 1, "ts": 0, "dur": 1000},
        launch(1, 1), kernel(10, 100, 1, "nvjet_sm90_tst_192x192"),        # 10-110
        launch(2, 2), kernel(110.5, 50, 2, "triton_poi_fused_mul_silu"),   # a 0.5 us gap
        launch(3, 3), kernel(150, 30, 3, "flash_bwd_kernel"),             # overlaps the one before: no gap
        launch(4, 4), kernel(300, 20, 4, lam),                              # a 120 us gap
        launch(5, 5), kernel(330, 10, 5, "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>"),
    ]}


def test_every_kernel_its_class_and_the_idle_time():
    ph = profile_tables.tables(_trace())["update_actor"]
    assert ph["device_s"] == pytest.approx(210e-6)
    assert ph["span_s"] == pytest.approx(330e-6) and ph["idle_s"] == pytest.approx(130.5e-6)
    assert ph["gaps"]["by_size"]["<2us"]["count"] == 1 and ph["gaps"]["by_size"]["<1ms"]["count"] == 1
    assert ph["gaps"]["by_size"]["<20us"] == {"count": 1, "s": pytest.approx(10e-6)}
    assert ph["gaps"]["largest_us"][0][0] == pytest.approx(120)
    assert len(ph["kernels"]) == 5
    assert ph["classes"] == pytest.approx({"matmul": 100e-6, "attention_bwd": 30e-6, "fused_elementwise": 50e-6,
                                          "copy": 20e-6, "optimizer": 10e-6})


def test_the_command(tmp_path):
    run = tmp_path / "profile" / "step_4"
    run.mkdir(parents=True)
    with gzip.open(run / "trace.json.gz", "wt") as f:
        json.dump(_trace(), f)
    out = tmp_path / "tables.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_tables.py"), str(tmp_path / "profile"),
                           str(out), "--note", "a test"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["what"] == "a test" and doc["phases"]["update_actor"]["idle_s"] == pytest.approx(130.5e-6)
    assert "update_actor: wall 0.001 s" in done.stdout
    empty = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_tables.py"), str(tmp_path / "none"),
                            str(out)], capture_output=True, text=True, timeout=120)
    assert empty.returncode != 0 and "no trace.json.gz" in empty.stderr
