"""Micro-batches that share one FSDP2 gather: the weights gathered once per mini-batch (or forward-only pass), the
gradients reduce-scattered once per mini-batch.

FSDP2 by default gathers each decoder layer's weights for every micro-batch's forward and again for its backward,
and reduce-scatters the layer's gradients after every backward: with M micro-batches per mini-batch, M times the
collectives that one pass needs. lathe's `fsdp_config.keep_gathered` (null: auto) keeps the gathered weights
across the micro-batches of one mini-batch and accumulates the gradients unsharded: one all-gather and one
reduce-scatter per mini-batch, at the cost of the whole weights in the compute dtype and the whole gradients in the
reduce dtype resident on each rank during the update (2 + 4 bytes a parameter under bf16 mixed precision; 2 in
forward-only passes). Auto turns it on where that costs at most `AUTO_SHARE` of the device's memory and the weights
are not offloaded. The gradients summed are the same either way (the reduction happens once on their sum instead of
once per part: equal up to float summation order).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence, TypeVar

import torch
from torch import nn

__all__ = ["AUTO_SHARE", "ATTR", "accumulating", "decide", "kept_gathered", "mark"]

AUTO_SHARE = 0.15          # auto: on when the resident whole weights + gradients take at most this share of memory
ATTR = "_lathe_keep_gathered"           # set on the sharded root by `lathe.train.parallel.shard`
RESHARD = "_lathe_reshard_after_forward"   # each FSDP2 module's own setting, to restore
T = TypeVar("T")


def decide(setting: bool | None, n_params: int, memory: int | None, *, offloaded: bool, tp: int = 1) -> bool:
    """`fsdp_config.keep_gathered`: True/False as set; None (auto): when the whole weights and gradients of
    `n_params` parameters (6 bytes each, over the tensor-parallel size) take at most AUTO_SHARE of the device's
    `memory` (bytes; None: a CPU, whose runs have no collectives worth saving and no known budget) and the weights are
    not offloaded. The memory plan (`lathe.train.memory`) asks the same question before anything loads."""
    if setting is not None:
        return bool(setting)
    return memory is not None and not offloaded and 6 * n_params / tp <= AUTO_SHARE * memory


def mark(model: nn.Module, setting: bool | None, device: torch.device, *, reshard_after_forward: bool,
         offloaded: bool, tp: int = 1) -> None:
    """After `lathe.train.parallel.shard_model` sharded `model`: record each group's reshard_after_forward (the
    root's False, the others' as configured) and whether its micro-batches keep the weights gathered (`decide`)."""
    for m in _fsdp_modules(model):
        setattr(m, RESHARD, m is not model and reshard_after_forward)
    from lathe.device import total_memory
    n_params = sum(p.numel() for p in model.parameters())
    memory = total_memory(device) if device.type == "cuda" else None
    setattr(model, ATTR, decide(setting, n_params, memory, offloaded=offloaded, tp=tp))


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)] if isinstance(model, FSDPModule) else []


def _keep(modules: list, keep: bool) -> None:
    for m in modules:
        m.set_reshard_after_forward(False if keep else getattr(m, RESHARD, True), recurse=False)


@contextmanager
def kept_gathered(model: nn.Module) -> Iterator[None]:
    """A forward-only pass over micro-batches: each layer gathered by the first micro-batch stays gathered for the
    rest; every group is freed at the end. A no-op unless the model is sharded with keep_gathered on."""
    modules = _fsdp_modules(model) if getattr(model, ATTR, False) else []
    _keep(modules, True)
    try:
        yield
    finally:
        _keep(modules, False)
        for m in modules:
            m.reshard()


def accumulating(model: nn.Module, micros: Sequence[T]) -> Iterator[T]:
    """The micro-batches of one optimizer step, in order; with keep_gathered on, the weights stay gathered and the
    gradients accumulate unsharded until the last one, whose backward reduce-scatters their sum and frees the
    weights. Every rank must run the same number of micro-batches (lathe's micro-batching guarantees it)."""
    modules = _fsdp_modules(model) if getattr(model, ATTR, False) and len(micros) > 1 else []
    _keep(modules, True)
    try:
        for i, micro in enumerate(micros):
            last = i == len(micros) - 1
            for m in modules:
                m.set_requires_gradient_sync(last, recurse=False)
                m.set_reshard_after_backward(last, recurse=False)
            yield micro
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        _keep(modules, False)
