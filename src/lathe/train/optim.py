"""Optimizer and learning-rate schedule from verl's `optim.*` keys."""

from __future__ import annotations

import math

import torch

from lathe.train.master import MasterAdamW
from lathe.train.offloaded_adamw import OffloadedAdamW
from lathe.train.precision import FP32, PrecisionPolicy


def build_optimizer(params, optim_cfg, *, policy: PrecisionPolicy = FP32, offload_params: bool = False,
                    offload_state: bool = False, sharded: bool = False) -> torch.optim.Optimizer:
    """AdamW with `optim.{lr, betas, weight_decay}`.

    One device: with a mixed `policy` (bf16 compute, fp32 master weights) or CPU offload, `MasterAdamW`, which casts
    the parameters to `policy.param_dtype` in place and keeps the masters; else `torch.optim.AdamW` on `params`.
    `sharded` (FSDP2 shards, whose mixed precision and `param_offload` FSDP2 does): `torch.optim.AdamW`, or with
    `offload_state` alone `OffloadedAdamW` (the moments in host memory; with `offload_params` FSDP2's offload policy
    keeps the shards and so AdamW's state there already).
    """
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay)
    if sharded:
        return (OffloadedAdamW(params, **kwargs) if offload_state and not offload_params
                else torch.optim.AdamW(params, **kwargs))
    if policy.mixed or offload_params or offload_state:
        return MasterAdamW(params, policy=policy, offload_params=offload_params, offload_state=offload_state,
                           **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    """`lr_warmup_steps` when >= 0, else `lr_warmup_steps_ratio * total_steps` (verl's rule)."""
    if optim_cfg.lr_warmup_steps is not None and optim_cfg.lr_warmup_steps >= 0:
        return int(optim_cfg.lr_warmup_steps)
    return int(optim_cfg.lr_warmup_steps_ratio * total_steps)


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio * lr`. Stepped once per RL step.

    The cosine makes `num_cycles` waves over the steps after warm-up (verl's default 0.5: one decay).
    """
    warm = warmup_steps(optim_cfg, total_steps)
    style = getattr(optim_cfg, "lr_scheduler_type", None) or getattr(optim_cfg, "warmup_style", "constant")
    min_ratio = getattr(optim_cfg, "min_lr_ratio", 0.0) or 0.0
    cycles = getattr(optim_cfg, "num_cycles", 0.5)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if style == "cosine":
            progress = min(1.0, (step - warm) / max(1, total_steps - warm))
            wave = max(0.0, 0.5 * (1 + math.cos(math.pi * 2.0 * cycles * progress)))
            return min_ratio + (1 - min_ratio) * wave
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
