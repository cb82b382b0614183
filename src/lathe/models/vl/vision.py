"""The vision tower (transformers' own module, built from `vision_config`) and splicing image embeddings into text.

The tower is transformers' class itself (`Qwen2_5_VisionTransformerPretrainedModel`, `Qwen3VLVisionModel`,
`Qwen3VLMoeVisionModel`, `Qwen3_5VisionModel`, `Qwen3_5MoeVisionModel`, `Glm4vVisionModel`, `Glm4vMoeVisionModel`), so
its parameter names and numerics are the checkpoint's; only that class is imported, never the full VL model.

Inputs are in the processor's layout: `pixel_values` (patches, C * temporal_patch * patch * patch), the patches of
all images end to end, and `image_grid_thw` (images, 3) in patches. Image i yields t*h*w / merge**2 embeddings.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from lathe.models.attention import varlen_signature

from lathe.models.vl.config import VLConfig
from lathe.models.vl.rope import image_token_count


@dataclass
class ImageEmbeddings:
    """What the vision tower gives the language model for a list of images, their tokens end to end.

    `embeds` (N, H) replace the N image placeholder tokens; `deepstack` (Qwen3-VL; empty for Qwen2.5-VL) holds one
    (N, H) tensor per early decoder layer, added to the image tokens' hidden states after that layer.
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    def per_image(self, image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list["ImageEmbeddings"]:
        """Split into one `ImageEmbeddings` per image (e.g. to cache an encoded image in a rollout engine)."""
        sizes = [image_token_count(g, spatial_merge_size) for g in image_grid_thw.tolist()]
        embeds = self.embeds.split(sizes)
        deep = [d.split(sizes) for d in self.deepstack]
        return [ImageEmbeddings(e, [d[i] for d in deep]) for i, e in enumerate(embeds)]

    @staticmethod
    def cat(images: list["ImageEmbeddings"]) -> "ImageEmbeddings":
        """Join per-image embeddings back, in the order their placeholders appear in the token stream."""
        if not images:
            raise ValueError("ImageEmbeddings.cat needs at least one image")
        deep = [torch.cat([im.deepstack[k] for im in images]) for k in range(len(images[0].deepstack))]
        return ImageEmbeddings(torch.cat([im.embeds for im in images]), deep)


def vision_classes(family: str):
    """(tower class, its config class) of transformers for a VL family."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLVisionConfig
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel, Qwen3VLVisionConfig
    if family == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
        return Qwen3VLMoeVisionModel, Qwen3VLMoeVisionConfig
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
        return Qwen3_5VisionModel, Qwen3_5VisionConfig
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
        return Qwen3_5MoeVisionModel, Qwen3_5MoeVisionConfig
    if family == "glm4v":
        from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
        from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel
        return Glm4vVisionModel, Glm4vVisionConfig
    if family == "glm4v_moe":
        from transformers.models.glm4v_moe.configuration_glm4v_moe import Glm4vMoeVisionConfig
        from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel
        return Glm4vMoeVisionModel, Glm4vMoeVisionConfig
    raise ValueError(f"VL family {family!r} has no vision tower in lathe; supported: qwen2_5_vl, qwen3_vl, "
                     "qwen3_vl_moe, qwen3_5, qwen3_5_moe, glm4v, glm4v_moe")


def build_vision_tower(cfg: VLConfig, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' vision tower for `cfg` (on the current default device; `torch.device("meta")` for loading).

    `attn_implementation` is transformers' name ("sdpa", "eager", "flash_attention_2")."""
    tower_cls, config_cls = vision_classes(cfg.family)
    vision_cfg = config_cls.from_dict(dict(cfg.vision))
    vision_cfg._attn_implementation = attn_implementation
    tower = tower_cls(vision_cfg)
    if attn_implementation == "sdpa":
        for block in tower.blocks:
            block.attn.__class__ = varlen_attention_class(type(block.attn))
    return tower


# -- one attention call per layer ------------------------------------------------------------------------------
_VARLEN_CLASSES: dict[type, type] = {}


def varlen_ok(x: torch.Tensor) -> bool:
    """Whether flash varlen attention runs on `x` (CUDA, fp16/bf16, a torch that has `varlen_attn`)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and varlen_signature() is not None


def attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """Non-causal attention within each `cu` segment: (N, heads, dim) in and out."""
    from torch.nn.attention.varlen import varlen_attn
    kwargs = {"window_size": (-1, -1)} if "window_size" in varlen_signature() else {"is_causal": False}
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def varlen_attention_class(base: type) -> type:
    """transformers' vision attention `base` whose forward makes one flash varlen call per layer over every window
    (Qwen2.5-VL) or image (Qwen3-VL) where it can, instead of transformers' SDPA path, which loops one call per
    window or image (Qwen2.5-VL-7B: 16 windows of a 448-pixel image, 28 windowed layers: 448 launches per image).
    Elsewhere (CPU, fp32) and for inputs it does not know, transformers' own forward runs. The parameters and their
    names are the base class's."""
    cls = _VARLEN_CLASSES.get(base)
    if cls is not None:
        return cls
    rotary = sys.modules[base.__module__].apply_rotary_pos_emb_vision

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, **kwargs) -> torch.Tensor:
        position_embeddings = kwargs.get("position_embeddings")
        if position_embeddings is None or not varlen_ok(hidden_states) or (self.training and self.attention_dropout):
            return base.forward(self, hidden_states, cu_seqlens=cu_seqlens, **kwargs)
        seq = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotary(q, k, *position_embeddings)
        cu = cu_seqlens.to(torch.int32)
        max_len = kwargs.get("max_seqlen")
        max_len = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        out = attend_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len)
        return self.proj(out.reshape(seq, -1))

    cls = type(f"Varlen{base.__name__}", (base,), {"forward": forward, "__module__": __name__})
    _VARLEN_CLASSES[base] = cls
    return cls


def rebuild_meta_buffers(tower: nn.Module, device: torch.device | str) -> None:
    """After a meta-device build and `load_state_dict(assign=True)`, recompute the non-persistent buffers (the
    rotary `inv_freq`) that no checkpoint holds, by building their modules again from the tower's config."""
    for name, module in list(tower.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device(device):
                fresh = type(module)(tower.config)
            if any(p.is_meta for p in module.parameters(recurse=False)):
                raise RuntimeError(f"vision tower module {name!r} still has meta parameters after loading; the "
                                   "checkpoint lacks its weights")
            for buf_name, buf in fresh.named_buffers(recurse=False):
                setattr(module, buf_name, buf)


def embed_images(tower: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageEmbeddings:
    """Run the vision tower: `pixel_values` (patches, C*tp*p*p), `image_grid_thw` (images, 3) -> ImageEmbeddings
    with (N, H) rows, N = sum of t*h*w / merge**2 over the images, in order."""
    if image_grid_thw is None or image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
        raise ValueError("image_grid_thw must be (images, 3) (temporal, height, width in patches), as the "
                         f"processor returns it; got {None if image_grid_thw is None else tuple(image_grid_thw.shape)}")
    patches = int(image_grid_thw.prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
        raise ValueError(f"pixel_values must be (patches, features) with patches = sum of t*h*w over "
                         f"image_grid_thw = {patches}; got {tuple(pixel_values.shape)}")
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=image_grid_thw, return_dict=True)
    return ImageEmbeddings(out.pooler_output, list(getattr(out, "deepstack_features", None) or []))


def merge_image_embeddings(inputs_embeds: torch.Tensor, image_embeds: torch.Tensor,
                           image_mask: torch.Tensor) -> torch.Tensor:
    """Token embeddings (..., H) with the rows where `image_mask` (...) is true replaced, in order, by
    `image_embeds` (N, H); N must equal the number of placeholders. Out of place and differentiable."""
    n = int(image_mask.sum())
    if n != image_embeds.shape[0]:
        raise ValueError(f"image tokens and image features do not match: {n} placeholder tokens in input_ids, "
                         f"{image_embeds.shape[0]} image embeddings; each image of grid (t, h, w) needs "
                         "t*h*w / spatial_merge_size**2 placeholders")
    mask = image_mask.unsqueeze(-1).expand_as(inputs_embeds)
    return inputs_embeds.masked_scatter(mask, image_embeds.to(inputs_embeds.dtype))
