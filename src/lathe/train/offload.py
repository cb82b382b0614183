"""CPU offload: verl's `fsdp_config.param_offload` / `optimizer_offload` switches, frozen weights kept in CPU
memory between uses (the reference's `param_offload`), and the activations a training forward saves for its backward
(`model.enable_activation_offload`: `activations_on_host`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lathe.device import device_api

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


# The offload's stream calls go through `cuda` and `_hold`, and tensors of the `SIDE_STREAM` device types take the
# side stream: a CPU test stands in for both (`tests/train/test_activation_offload.py`).
cuda = device_api("cuda")
SIDE_STREAM = ("cuda",)
_COPY_STREAMS: dict[torch.device, Any] = {}             # a device's side stream


def _hold(t: torch.Tensor, stream) -> None:
    """`t`'s memory is not handed out again before `stream`'s work queued so far is done."""
    t.record_stream(stream)


def _copy_stream(device: torch.device):
    """One side stream a device for the offload's copies, both ways (made once: streams are not freed)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = cuda.Stream(device=device)
    return _COPY_STREAMS[device]


class _OnHost:
    """A saved CUDA tensor's copy in pinned host memory, the `index`-th of its forward: `copied` is recorded after the
    copy to the host; `back` is its prefetched copy on the device (with `arrived`); `read` once the backward took it."""

    __slots__ = ("index", "device", "host", "copied", "back", "arrived", "read")

    def __init__(self, index: int, device: torch.device, host: torch.Tensor, copied):
        self.index, self.device, self.host, self.copied = index, device, host, copied
        self.back = self.arrived = None
        self.read = False

    def prefetch(self, stream) -> None:
        with cuda.stream(stream):
            stream.wait_event(self.copied)
            self.back = self.host.to(self.device, non_blocking=True)
            self.arrived = cuda.Event()
            self.arrived.record(stream)

    def take(self) -> torch.Tensor:
        """The tensor on the device for the backward, on the current stream."""
        current = cuda.current_stream(self.device)
        if self.back is not None:
            current.wait_event(self.arrived)
            tensor, self.back = self.back, None
            _hold(tensor, current)              # made on the side stream, used and freed on this one
        else:
            current.wait_event(self.copied)
            tensor = self.host.to(self.device, non_blocking=True)
        self.read = True
        return tensor


@contextmanager
def activations_on_host(enabled: bool, device_type: str = "cuda") -> Iterator[dict[str, int]]:
    """The tensors autograd saves, in the forwards inside the block, for their backward wait in pinned host memory
    until the backward reads them back (verl's `enable_activation_offload`). With gradient checkpointing these are
    each decoder layer's input (torch's non-reentrant checkpoint saves it outside the region it recomputes: the
    largest share, layers x tokens x hidden) and the log-prob pass's hidden states; without it, every activation.
    Parameters (and views of them), tensors off `device_type` (CUDA; the tests offload CPU tensors to other CPU
    memory) and tensors under `OFFLOAD_MIN_BYTES` stay where they are. Yields {"tensors", "bytes"} moved.

    On CUDA the copies run on a side stream, beside the compute stream's kernels, and the host waits for none of
    them (blocking copies to the host stalled it at every saved tensor, the device idle until the host had queued
    more: 0.5B's update with every layer recomputed took 2.30 s against 1.77 without offload,
    `e2e_actoff_ab_*_bdc8104_0.5b_*`). A copy to the host starts after the kernels that wrote its tensor; the
    tensor's memory returns to the allocator once the copy has read it (`record_stream`). The backward reads the
    nodes' saved tensors in about the reverse of the forward's order (a node's own in their order: a checkpointed
    layer's input, then its position embeddings), so each read starts the nearest tensor saved before it that is
    neither read nor on its way back (prefetched): after the first read every one is on the device or on its way
    when it is read, about one node's tensors ahead. A read of one not prefetched waits for its own copy. Events
    order each read after its copies. A tensor saved by several nodes (the position embeddings, by every layer) is
    copied once for each."""
    moved = {"tensors": 0, "bytes": 0}
    if not enabled:
        yield moved
        return
    saved: list[_OnHost] = []

    def pack(t: torch.Tensor):
        base = t if t._base is None else t._base
        size = t.numel() * t.element_size()
        if t.device.type != device_type or isinstance(base, nn.Parameter) or size < OFFLOAD_MIN_BYTES:
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
        moved["tensors"] += 1
        moved["bytes"] += size
        if t.device.type not in SIDE_STREAM:
            host.copy_(t)
            return t.device, host
        stream = _copy_stream(t.device)
        stream.wait_stream(cuda.current_stream(t.device))    # after the kernels that wrote t
        with cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = cuda.Event()
            copied.record(stream)
        _hold(t, stream)                # its memory not reused (by the forward's next kernels) before the copy read it
        saved.append(_OnHost(len(saved), t.device, host, copied))
        return saved[-1]

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if not isinstance(packed, _OnHost):
            device, host = packed
            return host.to(device)
        tensor = packed.take()
        for earlier in reversed(saved[:packed.index]):
            if not earlier.read and earlier.back is None:
                earlier.prefetch(_copy_stream(earlier.device))
                break
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield moved
