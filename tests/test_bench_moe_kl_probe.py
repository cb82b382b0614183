"""bench/moe_kl_probe.py on the CPU: in float32 and eager, the reference (`frozen_copy`) and the actor give the same
response log-probs in every mode the probe compares (the GPU's bf16 differences are its subject)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_moe_kl_probe", ROOT / "bench" / "moe_kl_probe.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_probe_pairs_agree_in_float32_on_the_cpu(tmp_path):
    doc = probe.main(["--shape", "tiny-gpt-oss", "--device", "cpu", "--workdir", str(tmp_path),
                      "--out", str(tmp_path / "out.json")])
    assert (tmp_path / "out.json").exists() and doc["device"] == "cpu"
    assert len(doc["pairs"]) == 10 + len(probe.PAIRS)
    for name, row in doc["pairs"].items():
        # (float32 on any CPU: micro-batches of 8 and 16 may sum in other orders, so a bound, not equality)
        assert row["max_abs"] < 1e-4 and abs(row["k3"]) < 1e-8, (name, row)
