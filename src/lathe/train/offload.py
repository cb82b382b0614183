"""CPU offload: verl's `fsdp_config.param_offload` / `optimizer_offload` switches, and frozen weights kept in CPU
memory between uses (the reference's `param_offload`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger("lathe")


def offload_flags(fsdp_cfg, device: torch.device, *, key: str, frozen: bool = False) -> dict[str, bool]:
    """verl's `param_offload` / `optimizer_offload` for one model, as `build_optimizer` takes them.

    They act on CUDA only: a CPU run has nothing to offload to, which is said once and ignored. A frozen model
    (the reference) has no optimizer state, so its `optimizer_offload` is said to have no effect."""
    if frozen and fsdp_cfg.optimizer_offload:
        log.warning("%s.optimizer_offload has no effect: a frozen model has no optimizer state (param_offload "
                    "is the reference's offload switch)", key)
    asked = {"offload_params": bool(fsdp_cfg.param_offload),
             "offload_state": bool(fsdp_cfg.optimizer_offload) and not frozen}
    if any(asked.values()) and device.type != "cuda":
        log.warning("%s: param_offload/optimizer_offload have no effect on a %s run (everything is in host "
                    "memory already)", key, device.type)
        return dict.fromkeys(asked, False)
    return asked


class HostWeights:
    """The parameters of a frozen `module` live in pinned CPU memory; `on_device()` brings them in for one use.

    Buffers stay on the device (they are small). The weights never change, so nothing is copied back: leaving
    `on_device()` only drops the device copies."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module, self.device = module.to(device), torch.device(device)
        self._host = {}
        for p in module.parameters():
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.device.type == "cuda")
            host.copy_(p.detach())
            p.data = host
            self._host[p] = host

    @contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        try:
            for p, host in self._host.items():
                p.data = host.to(self.device, non_blocking=True)
            yield self.module
        finally:
            for p, host in self._host.items():
                p.data = host
