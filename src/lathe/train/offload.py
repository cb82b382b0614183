"""Frozen weights kept in CPU memory between uses (verl's `ref.fsdp_config.param_offload`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


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
