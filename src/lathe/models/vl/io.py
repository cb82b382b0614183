"""Checkpoint files of lathe's VL models: which directories hold one, the names their tensors are saved under (the
hub's layouts of transformers 4 and 5), and writing one that transformers reads back."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lathe.models.vl.config import VL_ARCHITECTURES

# transformers 4.x (before 4.52) saved Qwen2.5-VL as `visual.*` and `model.layers.*`; today's names nest both
_LEGACY_VISUAL = re.compile(r"^visual\.")
_LEGACY_TEXT = re.compile(r"^model\.(?!language_model\.|visual\.)")


# Qwen3-VL-MoE's hub checkpoints hold each layer's experts stacked, (E, hidden, 2 x inter) and (E, inter, hidden): the
# modules' (E, 2 x inter, hidden) and (E, hidden, inter) transposed. transformers transposes on load where the shape
# is not the module's (its own saves keep the modules' layout); lathe reads both and writes the hub's.
FUSED_EXPERTS_ON_DISK = ("qwen3_vl_moe",)
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def module_expert_layout(state: dict[str, torch.Tensor], family: str, shapes: dict[str, torch.Size]
                         ) -> dict[str, torch.Tensor]:
    """`state` with a `FUSED_EXPERTS_ON_DISK` family's stacked experts in the modules' layout: transposed where
    their shape is not the module's (`shapes`, by name), as transformers reads them; other tensors as they are."""
    if family not in FUSED_EXPERTS_ON_DISK:
        return state
    return {k: v.transpose(1, 2).contiguous() if _STACKED_EXPERTS.search(k) and k in shapes and v.shape != shapes[k]
            else v for k, v in state.items()}


def hub_expert_layout(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The modules' stacked experts of a `FUSED_EXPERTS_ON_DISK` family in the hub's layout (for saving)."""
    if family not in FUSED_EXPERTS_ON_DISK:
        return state
    return {k: v.transpose(1, 2).contiguous() if _STACKED_EXPERTS.search(k) else v for k, v in state.items()}


def is_vl_checkpoint(path: str | Path) -> bool:
    """True when `<path>/config.json` names an architecture this package implements."""
    import json
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    with open(file) as f:
        d = json.load(f)
    return bool(set(d.get("architectures") or []) & VL_ARCHITECTURES.keys())


def rename_legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bring 4.x-era names (`visual.`, `model.layers.`) to the checkpoint names of transformers 5."""
    out = {}
    for name, t in state.items():
        name = _LEGACY_VISUAL.sub("model.visual.", name)
        name = _LEGACY_TEXT.sub("model.language_model.", name)
        out[name] = t
    return out


def checkpoint_names(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The names to write: Qwen2.5-VL in the hub's layout (as transformers 5 itself saves it, readable by every
    transformers and vLLM version), Qwen3-VL as its modules are named."""
    if family != "qwen2_5_vl":
        return dict(state)
    return {name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1): t
            for name, t in state.items()}


def save_vl_pretrained(model, path: str | Path, *,
                       max_shard_size: int | str = "5GB", state: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json and safetensors weights that transformers' `AutoModelForImageTextToText` (and
    `load_lathe_vl_model`) read back; `state` (the module's names) replaces the module's own tensors."""
    import json
    from safetensors.torch import save_file
    from lathe.models.io import SAFE_INDEX, SAFE_SINGLE, _shard, parse_size
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if state is None else state).items()}
    if model.config.family in FUSED_EXPERTS_ON_DISK:
        state = hub_expert_layout(state, model.config.family)
    elif model.config.text.moe is not None:     # Qwen3.5-MoE: one tensor per expert and projection, as on the hub
        from lathe.models.moe import split_expert_weights
        state = split_expert_weights(state)
    if model.config.text.rope_interleave:       # GLM-4.1V's language model (`lathe.models.glm4`)
        from lathe.models import glm4
        state = glm4.to_hub(state, model.config.text)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = checkpoint_names(state, model.config.family)
    shards = _shard(state, parse_size(max_shard_size))
    for stale in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        stale.unlink(missing_ok=True)
    names = [SAFE_SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(path / SAFE_INDEX, "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}, f, indent=2)
    config = dict(model.config.hf_config)
    config.pop("quantization_config", None)     # (weights read dequantised: `lathe.models.quantized`)
    config["architectures"] = [model.config.architecture]
    config["tie_word_embeddings"] = model.config.tie_word_embeddings
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    if dtype is not None:
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
            config[key] = str(dtype).replace("torch.", "")
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)


_TEXT = "model.language_model."


def language_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A VL checkpoint's tensors (transformers 5 names) as its language model alone names them (`model.*`,
    `lm_head.weight`); the vision tower's and any others left out."""
    return {name: state[key] for key, name in zip(state, _text_names(state)) if name is not None}


def language_model_names(names) -> set[str]:
    """`language_model_state`'s names of a VL checkpoint's tensor names."""
    return {name for name in _text_names(names) if name is not None}


def _text_names(names):
    for k in names:     # (a token-classification checkpoint's `score` head: a critic's)
        yield "model." + k[len(_TEXT):] if k.startswith(_TEXT) else (k if k == "lm_head.weight" or
                                                                     k.startswith("score.") else None)


def whole_vl_checkpoint(cfg, state: dict[str, torch.Tensor], dtype: torch.dtype | None, *, value: bool = False
                        ) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config.json) of the vision-language checkpoint whose language model `cfg` (with `vl_checkpoint`)
    describes and `state` holds under the text model's names (experts split, lm_head dropped when tied): the
    language model's tensors under the checkpoint's names, the vision tower's as the checkpoint has them (they do
    not train in this form) in `dtype`, and the checkpoint's own config.json with `dtype` brought up to date.
    `value`: a critic's (`score` head, no lm_head), whose config names transformers' token-classification class of
    the whole model (`Qwen3_5ForTokenClassification`: its backbone holds the vision tower too)."""
    import copy
    from lathe.models.io import read_state_dict
    source, d = cfg.vl_checkpoint
    out = {(_TEXT + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    tower = {k: v for k, v in rename_legacy_keys(read_state_dict(source, prefixes=("model.visual.", "visual."))).items()
             if k.startswith("model.visual.")}       # (the vision tower's tensors alone are read)
    if not tower:
        raise ValueError(f"{source}: the vision-language checkpoint this model's language model came from no longer "
                         "holds its vision tower (model.visual.*); a save would lose it. Fix: keep the original "
                         "checkpoint where actor_rollout_ref.model.path points until the run ends")
    out.update({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in tower.items()})
    config = copy.deepcopy(d)
    config.pop("quantization_config", None)     # (weights read dequantised: `lathe.models.quantized`)
    if value:
        config["architectures"] = [config["architectures"][0].replace("ForConditionalGeneration",
                                                                      "ForTokenClassification")]
        config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, num_labels=1, tie_word_embeddings=False)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        for sub in (config, config.get("text_config") or {}):
            for key in [k for k in ("dtype", "torch_dtype") if k in sub] or ["dtype"]:
                sub[key] = name
    return checkpoint_names(out, VL_ARCHITECTURES[d["architectures"][0]]), config
