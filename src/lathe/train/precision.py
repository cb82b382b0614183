"""The precision policy of one model: which dtype it computes in, accumulates gradients in, and updates.

verl's keys, FSDP2's semantics (`torch.distributed.fsdp.MixedPrecisionPolicy`):

- `fsdp_config.mixed_precision.param_dtype` (bf16): the dtype of the weights the model runs forward and
  backward with;
- `fsdp_config.mixed_precision.reduce_dtype` (fp32): the dtype gradients are accumulated in over
  micro-batches (and, on many devices, reduced in);
- `fsdp_config.model_dtype` (fp32): the dtype of the master weights the optimizer updates, and of its state.

On one device lathe realises it without FSDP (`lathe.train.master.MasterAdamW`): the module's parameters
are bf16 tensors (what the rollout engine also runs), the optimizer owns fp32 masters, hooks accumulate each
micro-batch's bf16 gradient into fp32 buffers, and every step casts the updated masters back into the module.
The FSDP2 path (many devices) hands the same policy to `fully_shard` through `fsdp2_policy`.

A frozen model (the reference policy) has nothing to update: it holds `param_dtype` weights only.
CPU runs compute in fp32 whatever the keys say (bf16 matmuls on a CPU are slow and only lose precision).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lathe.dtypes import short_name, to_dtype

log = logging.getLogger("lathe")

TRAINABLE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one model; `mixed` when the optimizer's weights differ from the ones the model computes with."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.master_dtype != self.param_dtype

    def describe(self) -> str:
        if not self.mixed:
            return f"{short_name(self.param_dtype)} weights and compute"
        return (f"{short_name(self.param_dtype)} compute, {short_name(self.master_dtype)} master weights, "
                f"{short_name(self.reduce_dtype)} gradients")

    def fsdp2_policy(self):
        """The same policy as FSDP2's `MixedPrecisionPolicy` (for `fully_shard(..., mp_policy=...)`)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


FP32 = PrecisionPolicy()


def resolve_policy(fsdp_cfg, device: torch.device, *, key: str, trainable: bool = True) -> PrecisionPolicy:
    """The policy `fsdp_cfg` (a verl `fsdp_config` group, named `key` in errors) asks for on `device`.

    CPU: fp32 throughout. CUDA: `mixed_precision.param_dtype` compute; a trainable model updates `model_dtype`
    weights and accumulates gradients in `reduce_dtype`; a frozen one holds `param_dtype` weights only.
    """
    mp = fsdp_cfg.mixed_precision
    param = to_dtype(mp.param_dtype, f"{key}.mixed_precision.param_dtype")
    reduce = to_dtype(mp.reduce_dtype, f"{key}.mixed_precision.reduce_dtype")
    master = to_dtype(fsdp_cfg.model_dtype, f"{key}.model_dtype")
    to_dtype(mp.buffer_dtype, f"{key}.mixed_precision.buffer_dtype")
    _check(key, param=param, reduce=reduce, master=master, buffer=mp.buffer_dtype)
    if torch.device(device).type != "cuda":
        return FP32
    if not trainable:
        return PrecisionPolicy(param_dtype=param, reduce_dtype=param, master_dtype=param)
    return PrecisionPolicy(param_dtype=param, reduce_dtype=reduce if master != param else master, master_dtype=master)


def _check(key: str, *, param: torch.dtype, reduce: torch.dtype, master: torch.dtype, buffer: str) -> None:
    """Combinations lathe does not implement fail with the fix in the message."""
    for name, dtype in (("mixed_precision.param_dtype", param), ("model_dtype", master),
                        ("mixed_precision.reduce_dtype", reduce)):
        if dtype not in TRAINABLE_DTYPES:
            raise ValueError(f"{key}.{name}={short_name(dtype)}: lathe trains in bf16 or fp32 (fp16 needs loss "
                             f"scaling, which lathe does not implement). Fix: set {key}.{name}=bf16 (or fp32).")
    if master == torch.bfloat16 and param == torch.float32:
        raise ValueError(f"{key}.model_dtype=bf16 with {key}.mixed_precision.param_dtype=fp32 would compute in fp32 "
                         f"on weights stored in bf16. Fix: set {key}.mixed_precision.param_dtype=bf16 (pure bf16), "
                         f"or {key}.model_dtype=fp32.")
    if to_dtype(buffer, f"{key}.mixed_precision.buffer_dtype") != torch.float32:
        raise ValueError(f"{key}.mixed_precision.buffer_dtype={buffer}: lathe keeps its only buffers (rotary "
                         f"frequencies) in fp32. Fix: set it to fp32 (verl's default) or leave it out.")
