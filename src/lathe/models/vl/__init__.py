"""Vision-language models: Qwen2.5-VL and Qwen3-VL on lathe's decoder layers (images; videos are refused).

`load_lathe_vl_model(path)` builds `LatheVLForConditionalGeneration` from a local checkpoint directory saved by
transformers (`architectures`: `Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration`), or raises
`UnsupportedArchitecture` for what lathe does not implement. Only transformers' vision-tower class is imported.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lathe.models.vl.config import VL_ARCHITECTURES, VLConfig
from lathe.models.vl.io import is_vl_checkpoint, rename_legacy_keys, save_vl_pretrained
from lathe.models.vl.model import LatheVLForConditionalGeneration, LatheVLTextModel
from lathe.models.vl.rope import MRotaryEmbedding, mrope_positions, packed_mrope_positions
from lathe.models.vl.vision import ImageEmbeddings, embed_images, merge_image_embeddings, rebuild_meta_buffers

__all__ = ["VL_ARCHITECTURES", "ImageEmbeddings", "is_vl", "LatheVLForConditionalGeneration", "LatheVLTextModel",
           "MRotaryEmbedding", "VLConfig", "embed_images", "is_vl_checkpoint", "load_lathe_vl_model",
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
    load_into(model, rename_legacy_keys(read_state_dict(path, dtype=dtype, device=device)), str(path))
    rebuild_meta_buffers(model.model.visual, device)
    return model
