"""Dtype names as verl's configs write them (`fp32`, `bf16`, `bfloat16`, `32`, ...) -> torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "16": torch.float16,
}


def to_dtype(name: str | torch.dtype, key: str) -> torch.dtype:
    """`name` (or a torch dtype) -> the torch dtype; an unknown name is an error naming `key`."""
    if isinstance(name, torch.dtype):
        return name
    if str(name) not in DTYPES:
        raise ValueError(f"{key}={name!r} is not a known dtype; use one of {', '.join(DTYPES)}")
    return DTYPES[str(name)]


def short_name(dtype: torch.dtype) -> str:
    """bf16 / fp32 / fp16 (for log lines and the memory plan)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def rollout_dtype(name: str, device: torch.device) -> torch.dtype:
    """The engine's dtype: `actor_rollout_ref.rollout.dtype` on CUDA (the config checked the name); float32 on CPU,
    where bf16 matmuls are slow and lose the trainer's numerics."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return to_dtype(name, "actor_rollout_ref.rollout.dtype")
