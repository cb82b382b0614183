"""Adding a micro-batch's bf16 (or fp16) gradient into its float32 accumulator in one vectorized pass.

`MasterAdamW`'s hook runs `acc.add_(grad)` for every parameter after every micro-batch. With an fp32 destination and a
bf16 source, PyTorch's elementwise kernel takes its mixed-dtype path (`unrolled_elementwise_kernel`, no vector
loads): on an H200 in a 1.5B GRPO update it was 109 ms for 16 micro-batches, about half the bandwidth the 10 bytes
an element need (`bench/results/e2e_profile_1.5b_nvidia-h200.json`: `CUDAFunctor_add<float>`, 5070 calls). This
kernel loads and stores wide: one program per block of elements, the bf16 value widened to fp32 and added, the
result rounded as PyTorch's (one fp32 add of the same two values: the bytes are equal).

Anything else (CPU, strided tensors, other dtypes, no Triton) goes through `add_`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096

if triton is not None:
    @triton.jit
    def _accumulate_kernel(ACC, G, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.load(ACC + offs, mask=ok)
        tl.store(ACC + offs, acc + tl.load(G + offs, mask=ok).to(tl.float32), mask=ok)


def fused(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether `accumulate_` takes the kernel for these two tensors (CUDA, fp32 += bf16/fp16, same shape, both
    contiguous)."""
    return (triton is not None and acc.device.type == "cuda" and acc.device == grad.device
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
