"""Compile `bench/decode_gemm_gluon.py`'s kernel for Hopper (sm_90) on a machine without a GPU: compile errors, shared
memory and register spills show here instead of in a GPU call.

    pip install --target /tmp/t36 triton==3.6.0          # the device's Triton (any Triton compiles; this one matches)
    PYTHONPATH=/tmp/t36 python bench/compile_sm90.py

A stand-in active driver reports a Hopper target and the kernel is compiled by `JITFunction.warmup` (never
launched); CPU tensors stand in for the device ones (only their dtypes, shapes and strides are read). Prints, per
configuration, the shared memory the kernel takes and the PTX's local-memory loads/stores (spills).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver

sys.path.insert(0, str(Path(__file__).resolve().parent))


class HopperStandIn(CudaDriver):
    """The CUDA driver's interface without libcuda: target sm_90, device 0, stream 0."""

    def __init__(self):         # CudaDriver's own set-up loads libcuda: skipped
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    triton.runtime.driver.set_active(HopperStandIn())
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import decode_gemm_gluon as dg
    bf16 = dg.gl.bfloat16
    shapes = {"1.5b gate_up": (17920, 1536), "1.5b down": (1536, 8960)}
    configs = [tuple(map(int, c.split(":"))) for c in dg.CONFIGS.split(",")]     # the bench's default sweep
    for name, (n, k) in shapes.items():
        for swiglu in ((False, True) if "gate_up" in name else (False,)):
            for bm, bn, warps, stages in configs:
                bn = bn // 2 if swiglu else bn
                n_out, mt = n // 2 if swiglu else n, 256 // bm
                x, w = torch.empty(256, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
                y = torch.empty(256, n_out, dtype=torch.bfloat16)
                ws, flags = torch.empty(132 * 2 * bm * bn), torch.zeros(132, dtype=torch.int32)
                xd = TensorDescriptor.from_tensor(x, [bm, 64], dg.gl.NVMMASharedLayout.get_default_for([bm, 64], bf16))
                wd = TensorDescriptor.from_tensor(w, [bn, 64], dg.gl.NVMMASharedLayout.get_default_for([bn, 64], bf16))
                try:
                    c = dg._streamk_kernel.warmup(xd, wd, y, ws, flags, 256, y.stride(0), k // 64,
                                                  mt * n_out // bn * (k // 64), n_out, mt, SWIGLU=swiglu,
                                                  STAGES=stages, num_warps=warps, grid=(132,))
                    spills = len(re.findall(r"(ld|st)\.local", c.asm["ptx"]))
                    print(f"{name} swiglu={swiglu} {bm}x{bn} w{warps} s{stages}: shared {c.metadata.shared} B, "
                          f"local loads/stores {spills}")
                except Exception as exc:
                    print(f"{name} swiglu={swiglu} {bm}x{bn} w{warps} s{stages}: {str(exc).splitlines()[-1][:200]}")


if __name__ == "__main__":
    main()
