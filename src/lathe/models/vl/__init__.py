"""Vision-language models: Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), GLM-4.1V and GLM-4.5V on lathe's decoder layers
(images; videos are refused).

`load_lathe_vl_model(path)` builds `LatheVLForConditionalGeneration` from a local checkpoint directory saved by
transformers (`architectures`: `Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`,
`Qwen3VLMoeForConditionalGeneration`, `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`,
`Glm4vForConditionalGeneration`, `Glm4vMoeForConditionalGeneration`), or
raises `UnsupportedArchitecture` for what lathe does not implement. Only transformers' vision-tower class is imported.

`load_language_model(path)` reads the language model of a Qwen3.5 checkpoint alone, as lathe's text decoder
(`LatheCausalLM`: everything lathe's text models do, tensor, expert and sequence parallelism among it), for runs
without images; what it saves is the whole checkpoint again, its vision tower as it was read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lathe.models.vl.config import HYBRID_TEXT, VL_ARCHITECTURES, VLConfig
from lathe.models.vl.io import (is_vl_checkpoint, language_model_state, module_expert_layout, rename_legacy_keys,
                                save_vl_pretrained)
from lathe.models.vl.model import LatheVLForConditionalGeneration, LatheVLTextModel
from lathe.models.vl.rope import MRotaryEmbedding, mrope_positions, packed_mrope_positions
from lathe.models.vl.vision import ImageEmbeddings, embed_images, merge_image_embeddings, rebuild_meta_buffers

__all__ = ["VL_ARCHITECTURES", "ImageEmbeddings", "is_vl", "LatheVLForConditionalGeneration", "LatheVLTextModel",
           "MRotaryEmbedding", "VLConfig", "embed_images", "is_vl_checkpoint", "language_model_runs_alone",
           "load_language_model", "load_lathe_vl_model",
           "merge_image_embeddings", "mrope_positions", "packed_mrope_positions", "rename_legacy_keys",
           "save_vl_pretrained"]


def is_vl(model) -> bool:
    """Whether `model` is lathe's vision-language model (the engine then takes image prompts)."""
    return isinstance(model, LatheVLForConditionalGeneration)


def load_lathe_vl_model(path: str | Path, dtype: torch.dtype = torch.float32, *, device: str | torch.device = "cpu",
                        vision_attn_implementation: str = "sdpa") -> LatheVLForConditionalGeneration:
    """A `LatheVLForConditionalGeneration` with the weights of the checkpoint directory `path`, in `dtype` on
    `device`; `vision_attn_implementation` is transformers' attention name for the vision tower."""
    from lathe.models.io import load_into, read_state_dict
    cfg = VLConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LatheVLForConditionalGeneration(cfg, vision_attn_implementation=vision_attn_implementation)
    state = module_expert_layout(rename_legacy_keys(read_state_dict(path, dtype=dtype, device=device)), cfg.family,
                                 {k: v.shape for k, v in model.state_dict().items()})
    load_into(model, state, str(path))
    rebuild_meta_buffers(model.model.visual, device)
    return model


def language_model_runs_alone(path: str | Path) -> bool:
    """Whether `load_language_model` reads the VL checkpoint `path` (the Qwen3.5 families', whose language model is
    lathe's hybrid text decoder)."""
    try:
        return VLConfig.from_pretrained(path).family in HYBRID_TEXT
    except (ValueError, OSError):
        return False


def load_language_model(path: str | Path, dtype: torch.dtype = torch.float32, *, device: str | torch.device = "cpu",
                        value: bool = False):
    """The language model of the Qwen3.5 vision-language checkpoint `path` as a `LatheCausalLM` (its text-only
    architecture, `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`), in `dtype` on `device`; its `save_pretrained`
    writes the whole checkpoint (`lathe.models.vl.io.whole_vl_checkpoint`). `value`: a `LatheValueModel` (a
    critic: the checkpoint's `score` head, or a zero one where it has none, as `load_lathe_value_model`), saved as
    transformers' token-classification form of the whole model (`Qwen3_5ForTokenClassification`: vision tower
    included)."""
    from lathe.models.config import UnsupportedArchitecture, read_config_json
    from lathe.models.decoder import LatheCausalLM
    from lathe.models.io import load_into, read_state_dict
    vl = VLConfig.from_pretrained(path)
    if vl.family not in HYBRID_TEXT:
        raise UnsupportedArchitecture(f"{path}: {vl.architecture}'s language model does not run alone in lathe "
                                      f"(only the Qwen3.5 families' do); load it with load_lathe_vl_model")
    d, _ = read_config_json(path)
    cfg = vl.text
    cfg.vl_checkpoint = (str(Path(path).resolve()), {**d, "architectures": [vl.architecture]})
    # (the language model's tensors alone are read: the vision tower stays on disk until a save copies it)
    state = language_model_state(read_state_dict(path, dtype=dtype, device=device,
                                                 prefixes=("model.language_model.", "lm_head.", "score.")))
    if not value:
        with torch.device("meta"):
            model = LatheCausalLM(cfg)
        load_into(model, state, str(path))
        return model
    from lathe.models import value_model_of
    state.pop("lm_head.weight", None)
    return value_model_of(cfg, state, str(path), dtype=dtype, device=device)
