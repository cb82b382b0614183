"""Training attention on flash-attn-4's CuTe kernels (`pip install flash-attn-4`): the packed backend "fa4"
(`lathe.models.attention`), chosen by verl's `actor_rollout_ref.model.override_config.attn_implementation=
flash_attention_4`.

torch's own `varlen_attn` is flash attention 2, written for Ampere: on Hopper it leaves the tensor cores' warpgroup
instructions and the bulk copy engine unused. flash-attn-4 ships Hopper (sm90) and Blackwell (sm100) forward and
backward kernels with packed sequences (`cu_seqlens`), grouped-query K/V at their own head count and the causal mask
aligned at each sequence's end when it has fewer queries than keys (as flash attention 2.1 and later align it).
The package compiles its kernels on first use (CuTe DSL, seconds each); lathe turns on its disk cache
(`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1` unless set; `FLASH_ATTENTION_CUTE_DSL_CACHE_DIR` moves it from
/tmp/$USER), so each kernel compiles once per machine. It is imported only when the backend is chosen: importing it
loads the CUTLASS DSL, ~12 s on an H200 machine.

Measured on an H200 (`bench/attention_train.py`, `bench/results/attention_train*_nvidia-h200.json`): forward +
backward 1.0-1.25x flash attention 2 at the e2e bench's 16 x 768-token micro-batches, 1.3-1.8x in ~37k-token
micro-batches from 768- to 8448-token sequences; a 1.5B GRPO step 1.8% faster at 768-token sequences and 3.8% at
2304 (`e2e_fa4_ab_*`). The rollout engine's prefill keeps torch's flash attention.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from lathe import device as accel

PACKAGE = "flash-attn-4"


def installed() -> bool:
    """Whether flash-attn-4 is importable (checked without importing it)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):       # a `flash_attn` without the `cute` subpackage (flash-attn 2)
        return False


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the "fa4" backend cannot run on `device` in `dtype`, or None where it can."""
    capability = accel.nvidia_capability(device)
    if capability is None:
        return f"it runs on NVIDIA GPUs only (this run's device is {torch.device(device).type}, not one)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"its kernels take fp16 or bf16 (this model computes in {dtype})"
    if capability[0] not in (9, 10, 11):
        name = accel.properties(torch.device(device).index or 0, "cuda")["name"]
        return f"its kernels are for Hopper (sm90) and Blackwell (sm100); {name} is sm{capability[0]}{capability[1]}"
    if not installed():
        return f"the package {PACKAGE} is not installed (pip install {PACKAGE})"
    return None


@functools.cache
def _kernel():
    # its compiled kernels kept on disk (the package's default is off): a run compiles each once per machine, not
    # once per process (a Ray rank, a resumed run); set the variable to 0 to turn it off
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int) -> torch.Tensor:
    """Causal attention of packed sequences: q (T, Hq, D) over k, v (Tk, Hkv, D), sequence s's queries
    q[cu_q[s]:cu_q[s+1]] being the last of its keys k[cu_k[s]:cu_k[s+1]]; Hkv divides Hq (grouped-query K/V go in
    at their own head count). Differentiable in q, k and v."""
    out, _ = _kernel()(q, k, v, cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                       max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), causal=True)
    return out
