"""bench/kv_fp8_decode.py on a CPU: it loads a kernel file as a module of its own, and refuses to time without CUDA."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "kv_fp8_decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kv_fp8_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_old_kernel_file_loads_as_its_own_module(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed")
    bench = _bench()
    old = tmp_path / "triton_decode_old.py"
    old.write_text((ROOT / "src" / "lathe" / "engine" / "triton_decode.py").read_text())
    module = bench.load_kernel(old)
    from lathe.engine import triton_decode
    assert module is not triton_decode and module._decode_kernel is not triton_decode._decode_kernel
    assert callable(module.paged_decode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_it_refuses_without_cuda():
    done = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "run it on a GPU" in done.stderr


def test_shapes_parse_and_bad_ones_are_named():
    bench = _bench()
    assert bench.parse_shape("1.5b_e2e:256:12:2:512") == ("1.5b_e2e", 256, 12, 2, 512, 128)
    assert bench.parse_shape("0.5b_e2e:256:14:2:512:64") == ("0.5b_e2e", 256, 14, 2, 512, 64)
    for bad in ("1.5b:256:12:2", "x:256:12:5:512", "x:0:12:2:512", "x:a:12:2:512", "x:8:12:2:512:63",
                "x:8:12:2:512:64:1"):
        with pytest.raises(Exception, match="--shape"):
            bench.parse_shape(bad)


def test_split_lists_parse_and_bad_ones_are_named():
    bench = _bench()
    assert bench.parse_ints("4,8,16") == [4, 8, 16]
    for bad in ("", "4,x", "0", "4,-1"):
        with pytest.raises(Exception, match="positive integers"):
            bench.parse_ints(bad)
    assert bench.parse_ints("0,256", least=0) == [0, 256]
    with pytest.raises(Exception, match="non-negative integers"):
        bench.parse_ints("-1", least=0)
