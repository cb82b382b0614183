"""LoRA on lathe's decoder (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted linear layer computes ``y = x W^T + b + s * dropout(x) A^T B^T`` with ``A`` (r x in), ``B`` (out x r)
and ``s = lora_alpha / r``; ``B`` starts at zero, so training starts from the base model. The layer keeps its own
``weight`` / ``bias`` under their Hugging Face names (frozen), and gains ``lora_A`` / ``lora_B``: everything that
reads or writes the base weights by name (the engine's weight sync, checkpoints, the reference) sees the same
names as without LoRA.

- ``apply_lora``: turn the targeted ``nn.Linear`` layers into ``LoRALinear`` in place (no copy of the weights);
  only the adapters are trainable, and the modules named in ``modules_to_save`` whole (PEFT's name: a value
  model's ``score`` head, as PEFT's TOKEN_CLS task keeps it). Targets follow PEFT: ``all-linear`` is every
  linear layer of the decoder (not ``lm_head``), a name matches a module whose path ends with it;
  ``exclude_modules`` likewise. The routed
  experts of a mixture-of-experts layer (`lathe.models.moe`: one grouped tensor per projection) are not linear
  layers, so they stay frozen (a target naming them is refused); with expert parallelism they are cut over the
  ranks (`lathe.train.expert_parallel`) beside adapters on the attention, dense-MLP and shared-expert layers.
- ``adapters_disabled``: the base model (the reference policy: no second copy of the weights).
- ``merged_weights``: ``W + s B A`` of each adapted layer, for the rollout engine and for a Hugging Face export
  (``merged_state``: the same from a full state dict, what a sharded model's ranks gather; ``merge_and_unload``:
  a model's LoRA layers turned back into plain merged ones).
- ``save_adapter`` / ``load_adapter``: PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors`` with
  ``base_model.model.<path>.lora_A.weight`` names, and a module to save under its own names, such as
  ``base_model.model.score.weight``), which ``peft.PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# where the adapted layers live: lathe's decoder, and a vision-language model's language model (its vision tower
# is left frozen, as verl's freeze_vision_tower)
DECODER_PREFIXES = ("model.layers.", "model.language_model.layers.")
PEFT_PREFIX = "base_model.model."
log = logging.getLogger("lathe")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update (built by `apply_lora` from an existing layer)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    lora_dropout: float
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        h = nn.functional.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + nn.functional.linear(nn.functional.linear(h.to(self.lora_A.dtype), self.lora_A),
                                          self.lora_B).to(out.dtype) * self.scaling

    def delta(self) -> torch.Tensor:
        """``s B A`` (out x in) in float32."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def target_names(model: nn.Module, target_modules: str | list[str], exclude_modules: str | list[str] | None,
                 *, key: str = "actor_rollout_ref.model") -> list[str]:
    """The module paths LoRA adapts (PEFT's matching: a path equal to or ending in ``.<name>``); `key`: the config
    group an error names."""
    glm4 = getattr(_text_config(model), "rope_interleave", False)

    def matches(path: str, names) -> bool:
        names = [names] if isinstance(names, str) else list(names or [])
        if glm4 and "gate_up_proj" in names:            # GLM-4's module, lathe's gate_proj + up_proj
            names += ["gate_proj", "up_proj"]
        return any(path == n or path.endswith("." + n) for n in names)

    linear = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and p.startswith(DECODER_PREFIXES)]
    if target_modules != "all-linear":
        _refuse_routed_experts(model, target_modules, linear, matches, key)
    chosen = linear if target_modules == "all-linear" else [p for p in linear if matches(p, target_modules)]
    chosen = [p for p in chosen if not matches(p, exclude_modules)]
    if not chosen:
        have = sorted({p.rsplit(".", 1)[-1] for p in linear})
        raise ValueError(f"{key}.target_modules={target_modules!r} (exclude_modules="
                         f"{exclude_modules!r}) matches no linear layer of the decoder. Fix: name some of {have}, "
                         "or use all-linear.")
    return chosen


def _refuse_routed_experts(model: nn.Module, target_modules: str | list[str], linear: list[str], matches,
                           key: str) -> None:
    """Raise for a target that names the routed experts of a mixture-of-experts layer: their module (``experts``),
    or one of their grouped weights (``gate_up_proj``) where it names no linear layer. Those weights are one
    (experts, out, in) tensor per projection, not linear layers, so LoRA leaves them frozen, as PEFT's target_modules
    does (verl's Megatron LoRA adapts each expert's linear_fc1/linear_fc2; lathe does not)."""
    from lathe.models.moe import sparse_blocks
    paths = {id(m): p for p, m in model.named_modules()}
    experts = {paths[id(b.experts)]: [n for n, _ in b.experts.named_parameters()] for b in sparse_blocks(model)}
    named = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    routed = [n for n in named if any(matches(p, [n]) for p in experts)
              or not any(matches(p, [n]) for p in linear)
              and any(matches(f"{p}.{leaf}", [n]) for p, leaves in experts.items() for leaf in leaves)]
    if routed:
        raise ValueError(f"{key}.target_modules={target_modules!r}: {routed} name(s) the routed "
                         "experts' grouped weights, which lathe's LoRA does not adapt (they are one tensor per "
                         "projection over all experts, not linear layers; with expert parallelism they are cut over "
                         "the ranks and stay frozen). Fix: leave them out of target_modules; all-linear adapts the "
                         "attention, dense-MLP and shared-expert layers.")


def apply_lora(model: nn.Module, *, rank: int, alpha: float, target_modules: str | list[str] = "all-linear",
               exclude_modules: str | list[str] | None = None, dropout: float = 0.0, seed: int = 0,
               modules_to_save: tuple[str, ...] = (), key: str = "actor_rollout_ref.model") -> list[str]:
    """Adapt `model` in place (see the module docstring); returns the adapted module paths. Every other parameter
    is frozen but those of `modules_to_save` (module paths, trained whole). `A` is initialised as PEFT does
    (Kaiming-uniform, a=sqrt(5)) from `seed`, `B` at zero. `key`: the config group an error names."""
    if rank < 1:
        raise ValueError(f"{key}.lora_rank={rank}: LoRA needs a rank >= 1")
    names = target_names(model, target_modules, exclude_modules, key=key)
    model.requires_grad_(False)
    for path in modules_to_save:
        model.get_submodule(path).requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    for path in names:
        layer = model.get_submodule(path)
        a = torch.empty(rank, layer.in_features)
        bound = math.sqrt(6 / ((1 + 5) * layer.in_features))          # kaiming_uniform_(a=sqrt(5))
        a.uniform_(-bound, bound, generator=gen)
        layer.__class__ = LoRALinear
        layer.lora_A = nn.Parameter(a.to(device=layer.weight.device, dtype=layer.weight.dtype))
        layer.lora_B = nn.Parameter(torch.zeros(layer.out_features, rank, device=layer.weight.device,
                                                dtype=layer.weight.dtype))
        layer.scaling, layer.lora_dropout, layer.lora_enabled = alpha / rank, float(dropout), True
    model.lora = {"r": rank, "lora_alpha": alpha, "lora_dropout": float(dropout), "target_modules": names,
                  "modules_to_save": list(modules_to_save)}
    return names


@torch.no_grad()
def cast_frozen(model: nn.Module, dtype: torch.dtype, *, adapters: torch.dtype | None = None) -> None:
    """The frozen (base) parameters to `dtype` (the compute dtype: bf16 on a GPU); the adapters keep theirs, or
    become `adapters` (the master dtype of a sharded model, whose shards are what its optimizer updates)."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)
        elif adapters is not None:
            p.data = p.data.to(adapters)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear))


def has_lora(model: nn.Module) -> bool:
    return next(lora_layers(model), None) is not None


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.lora_enabled = True


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + s B A`` in W's dtype, the adapters first rounded to W's dtype (as the module computes with them when the
    base is in the compute dtype), the sum in float32."""
    a, b = (t.to(weight.dtype).float() for t in (lora_A, lora_B))
    return (weight.float() + (b @ a) * scaling).to(weight.dtype)


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of `model` (by lathe's names, adapters included, such as a sharded model's gathered one)
    with every adapter merged into its layer's weight and the adapters' own tensors left out."""
    adapted = dict(lora_layers(model))
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        path, _, leaf = name.rpartition(".")
        out[name] = (merge(tensor, state[f"{path}.lora_A"], state[f"{path}.lora_B"], adapted[path].scaling)
                     if path in adapted and leaf == "weight" else tensor)
    return out


@torch.no_grad()
def merged_weights(model: nn.Module, *, only_adapted: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the model with every adapter merged (``W + s B A`` in W's dtype); the adapters'
    own tensors are left out. `only_adapted`: just the merged weights (the rest never changes under LoRA)."""
    adapted = dict(lora_layers(model))
    for name, tensor in model.state_dict().items():
        if is_adapter(name):
            continue
        path, _, leaf = name.rpartition(".")
        if path in adapted and leaf == "weight":
            yield name, (tensor.float() + adapted[path].delta()).to(tensor.dtype)
        elif not only_adapted:
            yield name, tensor


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """`model` with every LoRA layer turned back into a plain `nn.Linear` holding ``W + s B A`` (PEFT's name), in
    place; returns it."""
    for _, layer in list(lora_layers(model)):
        layer.weight.data = (layer.weight.float() + layer.delta()).to(layer.weight.dtype)
        del layer.lora_A, layer.lora_B
        layer.__class__ = nn.Linear
    if hasattr(model, "lora"):
        del model.lora
    return model


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """What an adapter file holds, by lathe's name: every layer's ``lora_A`` / ``lora_B`` and the parameters of the
    modules saved whole (`apply_lora`'s `modules_to_save`)."""
    own = {f"{p}.{leaf}": getattr(m, leaf) for p, m in lora_layers(model) for leaf in ("lora_A", "lora_B")}
    for path in getattr(model, "lora", {}).get("modules_to_save", ()):
        own.update((f"{path}.{n}", t) for n, t in model.get_submodule(path).named_parameters())
    return own


def adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`adapter_params` under PEFT's names (an adapter's ``<path>.lora_A.weight``, a saved module's parameter by its
    own name); `tensors` (by lathe's names) replaces the module's own (fp32 masters)."""
    return _peft_state(model, tensors)[0]


def _peft_state(model: nn.Module, tensors: dict[str, torch.Tensor] | None):
    """(`adapter_state`, the written rank of each GLM-4 gate_up_proj in units of the model's rank by its path)."""
    state = {name: (tensors[name] if tensors is not None else param).detach().to("cpu")
             for name, param in adapter_params(model).items()}
    ranks = {}
    cfg = _text_config(model)
    if getattr(cfg, "rope_interleave", False):          # GLM-4's checkpoint layout (`lathe.models.glm4`)
        from lathe.models import glm4
        state, ranks = glm4.adapter_to_hub(state, cfg)
    out = {}
    for name, value in state.items():
        name = _checkpoint_path(model, name)
        peft_name = f"{PEFT_PREFIX}{name}.weight" if is_adapter(name) else f"{PEFT_PREFIX}{name}"
        out[peft_name] = value.contiguous()
    return out, {_checkpoint_path(model, k): v for k, v in ranks.items()}


def _text_config(model: nn.Module):
    """The config of the model's language model (a VL model's `text`)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "text", cfg)


def save_adapter(model: nn.Module, path: str | Path, *, base_model: str | None = None,
                 tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """PEFT's adapter directory: `adapter_config.json` and `adapter_model.safetensors`."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = model.lora
    modules = sorted({p.rsplit(".", 1)[-1] for p in spec["target_modules"]})
    saved = spec.get("modules_to_save") or None         # a value model's head: PEFT's token-classification task
    config = {"peft_type": "LORA", "task_type": "TOKEN_CLS" if saved else "CAUSAL_LM",
              "base_model_name_or_path": base_model, "r": spec["r"],
              "lora_alpha": spec["lora_alpha"], "lora_dropout": spec["lora_dropout"], "bias": "none",
              "target_modules": modules, "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
              "init_lora_weights": True, "modules_to_save": saved, "layers_to_transform": None,
              "layers_pattern": None}
    same_leaves = {p for p, _ in _linear(model) if p.rsplit(".", 1)[-1] in modules}
    state, ranks = _peft_state(model, tensors)
    written = [_checkpoint_path(model, p) for p in spec["target_modules"]]
    if ranks:       # GLM-4: lathe's gate and up adapters written as one gate_up_proj adapter (`lathe.models.glm4`)
        written = list(dict.fromkeys(_gate_up_path(p) for p in written))
        config["target_modules"] = sorted({_gate_up_path(m) for m in modules})
        keys = {"gate_up_proj": next(iter(ranks.values()))} if len(set(ranks.values())) == 1 else ranks
        config["rank_pattern"] = {k: spec["r"] * n for k, n in keys.items()}          # PEFT's: each its rank and
        config["alpha_pattern"] = {k: spec["lora_alpha"] * n for k, n in keys.items()}   # alpha (scale alpha / r)
    if same_leaves != set(spec["target_modules"]):       # some layers of those names excluded: list the paths
        config["target_modules"] = "(?:" + "|".join(p.replace(".", r"\.") for p in written) + ")"
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(state, str(path / ADAPTER_WEIGHTS))
    model_type = _checkpoint_model_type(model)
    if renamed := sorted(set(modules) & _peft_retargets(model_type)):
        _warn_peft_retargets(model_type, tuple(renamed))
    return path


def _checkpoint_model_type(model: nn.Module) -> str | None:
    """The model_type of the checkpoint the adapter applies to (a VL checkpoint's, when its language model runs)."""
    cfg = getattr(model, "config", None)
    vl = getattr(cfg, "vl_checkpoint", None)
    hub = vl[1] if vl is not None else getattr(cfg, "hf_config", None) or {}
    return hub.get("model_type")


def _peft_retargets(model_type: str | None) -> set[str]:
    """The module names that PEFT's loader re-targets to a mixture-of-experts model's fused routed experts on this
    checkpoint type under transformers 5 (`peft.utils.transformers_weight_conversion`, PEFT 0.19 .. 0.21): every
    target so named, a shared expert's or a dense layer's too (huggingface/peft#3711). Empty where PEFT is not
    installed or lays that out otherwise."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        base = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        if base is None or get_checkpoint_conversion_mapping(model_type) is None:
            return set()
        return set(conversion._MOE_TARGET_MODULE_MAPPING.get(base, {}))
    except (ImportError, AttributeError, TypeError):
        return set()


@functools.cache
def _warn_peft_retargets(model_type: str, names: tuple[str, ...]) -> None:
    log.warning("LoRA: this adapter adapts %s layers named %s outside the routed experts (shared experts, dense MLPs). "
                "lathe reads it back exactly (resume, `lora_adapter_path`), and each checkpoint's merged model "
                "(`actor/huggingface`) holds the trained weights; but PEFT 0.21 under transformers 5 re-targets those "
                "names to the routed experts when it loads an adapter onto this model type "
                "(huggingface/peft#3711), so `PeftModel.from_pretrained` would apply it to other weights",
                model_type, ", ".join(names))


def _gate_up_path(path: str) -> str:
    """GLM-4's module of lathe's gate_proj / up_proj (`lathe.models.glm4`)."""
    for leaf in ("gate_proj", "up_proj"):
        if path == leaf or path.endswith(".mlp." + leaf):
            return path[:-len(leaf)] + "gate_up_proj"
    return path


_VL_TEXT = "model.language_model."      # a VL checkpoint's language model, run alone (`lathe.models.vl`)


def _checkpoint_path(model: nn.Module, path: str) -> str:
    """A module path as the model's checkpoint names it: a VL checkpoint's language model run alone
    (`config.vl_checkpoint`) saves its adapters for the whole model, which PEFT applies to that checkpoint."""
    if getattr(getattr(model, "config", None), "vl_checkpoint", None) is not None and path.startswith("model."):
        return _VL_TEXT + path[len("model."):]
    return path


def model_paths(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (as `read_adapter` returns them) under the model's own module paths (see `_checkpoint_path`), in its
    layers' layout (GLM-4's: `lathe.models.glm4.adapter_to_modules`)."""
    if getattr(getattr(model, "config", None), "vl_checkpoint", None) is not None:
        tensors = {("model." + k[len(_VL_TEXT):] if k.startswith(_VL_TEXT) else k): t for k, t in tensors.items()}
    cfg = _text_config(model)
    if getattr(cfg, "rope_interleave", False):
        from lathe.models import glm4
        tensors = glm4.adapter_to_modules(tensors, cfg, model.lora["r"])
    return tensors


def _linear(model: nn.Module):
    return ((p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear) and p.startswith("model.layers."))


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, {lathe name: tensor}) of a PEFT adapter directory."""
    from safetensors.torch import load_file
    path = Path(path).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} is not a PEFT LoRA adapter directory: expected {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS} (what peft's save_pretrained writes)")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    saved = list(config.get("modules_to_save") or [])
    if config.get("task_type") == "TOKEN_CLS":             # (PEFT adds its token-classification heads to these)
        saved += ["classifier", "score"]
    tensors = {}
    for name, t in load_file(str(path / ADAPTER_WEIGHTS)).items():
        lathe = name[len(PEFT_PREFIX):].replace(".default", "")
        if name.startswith(PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight")):
            tensors[lathe[:-len(".weight")]] = t
        elif name.startswith(PEFT_PREFIX) and any(lathe.startswith(m + ".") for m in saved):
            tensors[lathe] = t                               # a module saved whole (a value model's head)
        else:
            raise ValueError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} is neither a LoRA A/B matrix nor a "
                             f"parameter of its modules_to_save {saved} (lathe reads plain LoRA adapters: no DoRA)")
    return config, tensors


def check_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> dict[str, nn.Parameter]:
    """The model's adapter parameters by lathe's name, once `tensors` (`read_adapter`'s, through `model_paths`) is
    known to fit them: a missing, extra or misshapen tensor is an error naming it. (A sharded parameter reports its
    full shape.)"""
    own = adapter_params(model)
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"{source}: the adapter does not fit this model's LoRA layers (missing {missing[:4]}, "
                         f"unexpected {extra[:4]}). Fix: use the lora_rank/target_modules the adapter was trained "
                         "with, and the same base architecture.")
    for name, param in own.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, the model's LoRA layer "
                             f"{tuple(param.shape)}. Fix: set lora_rank to the adapter's r.")
    return own


@torch.no_grad()
def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy adapter tensors (`read_adapter`'s, through `model_paths`) into an adapted model (not sharded); see
    `check_adapter` for the errors."""
    for name, param in check_adapter(model, tensors, source).items():
        param.copy_(tensors[name])
