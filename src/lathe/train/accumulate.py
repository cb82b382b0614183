"""Adding a micro-batch's bf16 (or fp16) gradient into its float32 accumulator in one vectorized pass.

`MasterAdamW`'s hook runs `acc.add_(grad)` for every parameter after every micro-batch. With an fp32 destination and a
bf16 source, PyTorch's elementwise kernel takes its mixed-dtype path (`unrolled_elementwise_kernel`, no vector
loads): on an H200 in a 1.5B GRPO update it was 109 ms for 16 micro-batches, about half the bandwidth the 10 bytes
an element need (`bench/results/e2e_profile_1.5b_nvidia-h200.json`: `CUDAFunctor_add<float>`, 5070 calls). This
kernel loads and stores wide: one program per block of elements, the bf16 value widened to fp32 and added, the
result rounded as PyTorch's (one fp32 add of the same two values: the bytes are equal).

Over every parameter of a 1.5B model the kernel on every tensor lost to add_ (the host's launches of 338 tensors,
most of them small, were the bound), so tensors under MIN_NUMEL elements keep `add_` (`bench/grad_accumulate.py`;
in the 1.5B update the kernel on every tensor took 64 ms of device time against add_'s 109, and the update's wall
time did not move: `e2e_profile_accumulate_1.5b_nvidia-h200.json`). Anything else (CPU, strided tensors, other
dtypes, no Triton) goes through `add_` too.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096
MIN_NUMEL = 1 << 20     # smaller tensors: add_ (a Triton launch costs the host more than their add costs the device)

if triton is not None:
    @triton.jit
    def _accumulate_kernel(ACC, G, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.load(ACC + offs, mask=ok)
        tl.store(ACC + offs, acc + tl.load(G + offs, mask=ok).to(tl.float32), mask=ok)


def fused(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether `accumulate_` takes the kernel for these two tensors (CUDA, fp32 += bf16/fp16, same shape, both
    contiguous, at least MIN_NUMEL elements)."""
    return (triton is not None and acc.device.type == "cuda" and acc.device == grad.device and acc.numel() >= MIN_NUMEL
            and acc.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and acc.shape == grad.shape and acc.is_contiguous() and grad.is_contiguous())


@torch.no_grad()
def accumulate_(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """acc += grad (acc float32, grad bf16/fp16 of its shape), in place; returns acc."""
    if not fused(acc, grad):
        return acc.add_(grad)
    return launch(acc, grad)


def launch(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The kernel itself on contiguous `acc` (fp32) and `grad` (any float type) of one numel (the tests run it on CPU
    tensors under Triton's interpreter)."""
    n = acc.numel()
    if n:
        _accumulate_kernel[(triton.cdiv(n, BLOCK),)](acc, grad, n, BLOCK=BLOCK, num_warps=8)
    return acc
