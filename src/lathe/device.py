"""The one place that asks the accelerator about itself (memory queries; CUDA here, CPU answers nothing) and
moves small host tensors to it without waiting for it.

Issue 14 grows this into the device layer (cuda / rocm / npu / cpu discovery, visible-devices variables,
collective backends); what lives here now is what the trainer's memory plan and metrics need.
"""

from __future__ import annotations

import torch

GIB = 1024 ** 3


def is_accelerator(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def total_memory(device: torch.device | str) -> int | None:
    """Bytes of memory on `device`, or None for the CPU (host memory is not planned)."""
    device = torch.device(device)
    if not is_accelerator(device):
        return None
    return torch.cuda.get_device_properties(device).total_memory


def reset_peak_memory(device: torch.device | str) -> None:
    if is_accelerator(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_memory(device: torch.device | str) -> tuple[int, int] | None:
    """(peak allocated, peak reserved) bytes since the last `reset_peak_memory`, or None on the CPU."""
    device = torch.device(device)
    if not is_accelerator(device):
        return None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: CUDA copies go through pinned memory (a copy
    from pageable memory may wait for the stream's queued work, which would stall the engine's overlap)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def empty_cache(device: torch.device | str) -> None:
    """Return the allocator's cached blocks to the device (nothing to do on the CPU)."""
    if is_accelerator(device):
        torch.cuda.empty_cache()


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    if is_accelerator(device):
        torch.cuda.synchronize(torch.device(device))
