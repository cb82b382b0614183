"""bench/rm.py's CPU smoke run: a tiny random reward model scored by lathe's packed path and transformers' padded
path through the worker's code, the two agreeing, the JSON written. Loaded by its path under a name of its own."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rm_bench_runs_on_cpu(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_rm", ROOT / "bench" / "rm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rm.json"
    monkeypatch.setattr(sys, "argv", ["rm.py", "--shape", "tiny", "--device", "cpu", "--rows", "12", "--prompt-len",
                                      "8", "--max-response", "40", "--max-tokens", "128", "--repeats", "1",
                                      "--git-sha", "abc", "--out", str(out)])
    bench.main()
    res = json.loads(out.read_text())
    assert res["git_sha"] == "abc" and res["device"] == "cpu" and res["torch"]
    assert "packed" in res["impl"] and res["micro_batches"] > 1
    assert res["agree"] and res["rel_err"] < 1e-4 and res["score_std"] > 0.01
    assert res["tokens"] < res["padded_tokens"]
    for side in ("lathe", "transformers"):
        assert res[side]["tokens_per_s"] > 0
    assert abs(res["ratio"] - res["lathe"]["tokens_per_s"] / res["transformers"]["tokens_per_s"]) < 1e-2
