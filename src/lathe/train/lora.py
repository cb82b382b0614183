"""Training a LoRA model (`lathe.models.lora`) on one device or as a rank of an FSDP2 group: where its weights live,
what the rollout engine receives, and its checkpoint.

- `adapt`: LoRA on a model a worker trains (the actor's, the critic's), from an adapter directory when given.
- `place`: the frozen base in the compute dtype (bf16 on a GPU), as on one device. On one device the adapters keep
  their dtype (`MasterAdamW` makes their fp32 masters); sharded, they become the master dtype, because FSDP2's
  shards *are* what the optimizer updates (its mixed-precision policy gathers them in the compute dtype). The
  adapters sit inside their decoder layer, so `fully_shard` shards them with it; FSDP2 keeps one DTensor per
  parameter, so a group mixing frozen and trainable ones only reduces (and the optimizer, the gradient norm and
  clipping only see) the adapters' gradients.
- `engine_weights`: ``W + (alpha/r) B A`` of the adapted layers only (nothing else changes under LoRA); sharded,
  one decoder layer is gathered at a time (its base weights and adapters) and merged.
- `save_lora` / `load_lora`: the same layout whatever the number of ranks: `lora_adapter/` (PEFT's, fp32 masters),
  `huggingface/` (the merged model, what `lathe export` copies) and `optim.pt` (the adapters' optimizer state and
  the scheduler). The base never changes, and the adapters and their optimizer state are small, so a sharded
  run's rank 0 gathers them whole (by parameter name) instead of writing DCP shards; any checkpoint then resumes on
  any number of ranks, one process included.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from lathe.models.lora import (apply_lora, cast_frozen, check_adapter, load_adapter, merge, merged_state,
                               merged_weights, model_paths, read_adapter, save_adapter)
from lathe.models.moe import sparse_blocks
from lathe.train import parallel
from lathe.train.optim import check_optimizer_class, optimizer_name

LORA_ADAPTER = "lora_adapter"
log = logging.getLogger("lathe")


def adapt(model: nn.Module, model_cfg, *, key: str, role: str, seed: int, modules_to_save: tuple[str, ...] = ()
          ) -> list[str]:
    """`apply_lora` with the LoRA keys of `model_cfg` (the config group at `key`: `actor_rollout_ref.model`,
    `critic.model`; keys it lacks take their defaults), then the adapter of its `lora_adapter_path` when given;
    logs what trains. Returns the adapted module paths."""
    names = apply_lora(model, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                       target_modules=model_cfg.target_modules,
                       exclude_modules=getattr(model_cfg, "exclude_modules", None),
                       dropout=getattr(model_cfg, "lora_dropout", 0.0), seed=seed, modules_to_save=modules_to_save,
                       key=key)
    adapter = getattr(model_cfg, "lora_adapter_path", None)
    if adapter:
        load_adapter(model, model_paths(model, read_adapter(adapter)[1]), f"{key}.lora_adapter_path={adapter}")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(p.numel() for block in sparse_blocks(model) for p in block.experts.parameters())
    log.info("%s: LoRA rank %d on %d layers%s: %.2fM trainable parameters of %.1fM%s", role, model_cfg.lora_rank,
             len(names), f" (and {', '.join(modules_to_save)} whole)" if modules_to_save else "", trained / 1e6,
             sum(p.numel() for p in model.parameters()) / 1e6,
             f" (the routed experts' {experts / 1e6:.1f}M frozen)" if experts else "")
    return names


def place(model: nn.Module, policy, device: torch.device, *, sharded: bool) -> None:
    """The dtypes (and, on one device, the device) of a LoRA model's parameters before its optimizer is built;
    sharded, the weights stay in host memory until `fully_shard` moves each rank's shards to the device."""
    if sharded:
        cast_frozen(model, policy.param_dtype, adapters=policy.master_dtype)
    else:
        cast_frozen(model, policy.param_dtype)
        model.to(device=device)


def engine_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, merged weight) of every adapted layer, for the rollout engine: a sharded model's ranks all iterate it
    (each decoder layer is gathered, merged and freed in turn)."""
    if not parallel.in_group():
        yield from merged_weights(model, only_adapted=True)
        return
    with torch.no_grad():
        for _, own in parallel.gathered_groups(model):
            params = dict(own())
            for name in params:
                if name.endswith(".lora_A"):       # tensor-parallel: DTensors on the tp mesh, gathered whole
                    path = name[:-len(".lora_A")]
                    w, a, b = (parallel.to_local(params[f"{path}.{leaf}"].detach())
                               for leaf in ("weight", "lora_A", "lora_B"))
                    yield f"{path}.weight", merge(w, a, b, model.get_submodule(path).scaling)


def save_lora(path: Path, model: nn.Module, optimizer, scheduler, *, base_model: str | None) -> None:
    """A LoRA model's checkpoint (see the module docstring); a sharded model's ranks all call this, rank 0 writes."""
    sharded = parallel.in_group()
    if sharded:                              # every rank gathers, rank 0 gets the full tensors
        state = parallel.full_state(model)   # the adapters' shards are their fp32 masters
        optim = parallel.full_optimizer_state(model, optimizer)
        if parallel.rank() != 0:
            return
        adapters, merged = state, merged_state(model, state)
    else:
        masters = getattr(optimizer, "master_state_dict", None)
        adapters, merged = (masters(model) if masters else None), dict(merged_weights(model))
        optim = optimizer.state_dict()
    path.mkdir(parents=True, exist_ok=True)
    save_adapter(model, path / LORA_ADAPTER, base_model=base_model, tensors=adapters)
    model.save_pretrained(path / "huggingface", safe_serialization=True, state_dict=merged)
    torch.save({"optimizer": optim, "scheduler": scheduler.state_dict(), "lora": True, "by_name": sharded,
                "optimizer_class": optimizer_name(optimizer)}, path / "optim.pt")


def load_lora(path: Path, model: nn.Module, optimizer, scheduler, *, what: str) -> None:
    """Restore what `save_lora` wrote, by one process or by any number of ranks (every rank calls this); the base
    weights are the run's starting model, unchanged."""
    if not (path / "optim.pt").exists() or not (path / LORA_ADAPTER).is_dir():
        raise FileNotFoundError(f"{what} checkpoint {path} holds no LoRA adapter ({LORA_ADAPTER}/ and optim.pt): it "
                                "was saved by a run without LoRA. Resume it with lora_rank=0, or start a new run.")
    source = f"{what} checkpoint {path}"
    tensors = model_paths(model, read_adapter(path / LORA_ADAPTER)[1])
    opt = torch.load(path / "optim.pt", weights_only=True, map_location="cpu")
    check_optimizer_class(opt, optimizer, path, what)
    saved = opt["optimizer"]
    if parallel.in_group():
        check_adapter(model, tensors, source)
        parallel.load_full_params(model, tensors, optimizer, saved if opt.get("by_name") else
                                  _optim_by_name(model, saved))
    else:
        load_adapter(model, tensors, source)
        load_masters = getattr(optimizer, "load_master_state_dict", None)
        if load_masters is not None:
            load_masters(model, tensors)
        optimizer.load_state_dict(_optim_by_index(model, saved) if opt.get("by_name") else saved)
    scheduler.load_state_dict(opt["scheduler"])


def _trainable(model: nn.Module) -> list[str]:
    """The names of the parameters an optimizer built from `model.parameters()` holds, in its order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _optim_by_name(model: nn.Module, state: dict) -> dict:
    """A one-process optimizer's `state_dict()` (parameters by index) keyed by parameter name instead."""
    names = _trainable(model)
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def _optim_by_index(model: nn.Module, state: dict) -> dict:
    """The inverse of `_optim_by_name`; a name the model does not train is an error naming it."""
    index = {n: i for i, n in enumerate(_trainable(model))}
    unknown = sorted(n for g in state["param_groups"] for n in g["params"] if n not in index)
    if unknown:
        raise KeyError(f"the checkpoint's optimizer state holds parameters this model does not train: {unknown[:4]}")
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
