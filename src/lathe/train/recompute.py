"""Gradient checkpointing of a trained model, from its model group's keys: `enable_gradient_checkpointing` and
`gradient_checkpointing_layers` (the first N decoder layers recompute, the rest keep their activations;
`lathe.models.decoder.recomputes`). The config checks refuse a count with checkpointing off before any model loads
(`lathe.config.rules_recompute`); which implementation runs a model is known only once it is loaded, so a count for a
transformers model is refused here."""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("lathe")


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding a lathe model's decoder layers and checkpointing switches (the VL model's language model)."""
    return getattr(model.model, "language_model", model.model)


def enable_recompute(model: nn.Module, enable: bool, layers: int | None, group: str, *, lathe: bool,
                     impl_key: str) -> None:
    """Switch on `model`'s gradient checkpointing as its model group (dotted `group`) asks: `enable` its
    enable_gradient_checkpointing, `layers` its gradient_checkpointing_layers; `lathe`: the model is lathe's decoder (a
    transformers model is trained without checkpointing, and a count of recomputed layers for it is refused: it could
    not act); `impl_key` names the key that picks the implementation."""
    if not lathe:
        if layers is not None:
            raise ValueError(f"{group}.gradient_checkpointing_layers={layers}: only lathe's decoder recomputes part "
                             f"of its layers, but {type(model).__name__} runs through transformers (an architecture "
                             f"lathe's decoder does not implement, or {impl_key}=hf). Fix: remove it (null), or use an "
                             f"architecture lathe's decoder implements with {impl_key}=auto.")
        return
    if not enable:
        return
    model.gradient_checkpointing_enable(layers=layers)
    if layers is not None:
        stack = decoder_stack(model)
        total = len(stack.layers) + len(getattr(stack, "mtp_layers", None) or ())
        log.info("%s.gradient_checkpointing_layers=%d: the first %d of %d decoder layers recompute in backward, the "
                 "others keep their activations", group, layers, min(layers, total), total)
