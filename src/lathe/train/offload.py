"""CPU offload: verl's `fsdp_config.param_offload` / `optimizer_offload` switches, frozen weights kept in CPU
memory between uses (the reference's `param_offload`), and the activations a training forward saves for its backward
(`model.enable_activation_offload`: `activations_on_host`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger("lathe")


def offload_flags(fsdp_cfg, device: torch.device, *, key: str, frozen: bool = False,
                  sharded: bool = False) -> dict[str, bool]:
    """verl's `param_offload` / `optimizer_offload` for one model, as `build_optimizer` takes them.

    They act on CUDA only: a CPU run has nothing to offload to, which is said once and ignored. A frozen model
    (the reference) has no optimizer state, so its `optimizer_offload` is said to have no effect. `sharded` (FSDP2,
    `build_optimizer(sharded=True)`): the parameters count as offloaded with `offload_policy` too (FSDP2's offload of
    shards and optimizer state together, which `lathe.train.parallel.shard` applies)."""
    if frozen and fsdp_cfg.optimizer_offload:
        log.warning("%s.optimizer_offload has no effect: a frozen model has no optimizer state (param_offload "
                    "is the reference's offload switch)", key)
    asked = _asked(fsdp_cfg, frozen=frozen, sharded=sharded)
    if any(asked.values()) and device.type != "cuda":
        log.warning("%s: param_offload/optimizer_offload have no effect on a %s run (everything is in host "
                    "memory already)", key, device.type)
        return dict.fromkeys(asked, False)
    return asked


def requested_offload(fsdp_cfg, device: torch.device, *, sharded: bool = False) -> dict[str, bool]:
    """What `offload_flags` returns for a trained model, without saying anything (a check before the model loads)."""
    asked = _asked(fsdp_cfg, frozen=False, sharded=sharded)
    return asked if torch.device(device).type == "cuda" else dict.fromkeys(asked, False)


def _asked(fsdp_cfg, *, frozen: bool, sharded: bool) -> dict[str, bool]:
    return {"offload_params": bool(fsdp_cfg.param_offload or sharded and getattr(fsdp_cfg, "offload_policy", False)),
            "offload_state": bool(fsdp_cfg.optimizer_offload) and not frozen}


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


OFFLOAD_MIN_BYTES = 1 << 20     # a saved tensor smaller than this stays on the device: its copy would cost more


def activation_offload(enabled: bool, device: torch.device, *, key: str) -> bool:
    """verl's `model.enable_activation_offload` for a model trained on `device`: on CUDA only (a CPU run keeps
    everything in host memory already: said once)."""
    if enabled and device.type != "cuda":
        log.warning("%s has no effect on a %s run (the activations are in host memory already)", key, device.type)
    return enabled and device.type == "cuda"


@contextmanager
def activations_on_host(enabled: bool, device_type: str = "cuda") -> Iterator[dict[str, int]]:
    """The tensors autograd saves, in the forwards inside the block, for their backward wait in pinned host memory
    until the backward reads them back (verl's `enable_activation_offload`). With gradient checkpointing these are
    each decoder layer's input (torch's non-reentrant checkpoint saves it outside the region it recomputes: the
    largest share, layers x tokens x hidden) and the log-prob pass's hidden states; without it, every activation.
    Parameters (and views of them), tensors off `device_type` (CUDA; the tests offload CPU tensors to other CPU
    memory) and tensors under `OFFLOAD_MIN_BYTES` stay where they are. The copies are in the compute stream's order
    (verl's offload overlaps them on a stream of their own): memory for time. Yields {"tensors", "bytes"} moved."""
    moved = {"tensors": 0, "bytes": 0}
    if not enabled:
        yield moved
        return

    def pack(t: torch.Tensor):
        base = t if t._base is None else t._base
        size = t.numel() * t.element_size()
        if t.device.type != device_type or isinstance(base, nn.Parameter) or size < OFFLOAD_MIN_BYTES:
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=device_type == "cuda")
        host.copy_(t)
        moved["tensors"] += 1
        moved["bytes"] += size
        return t.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield moved
