"""Tiny random transformers Qwen2.5-VL / Qwen3-VL(-MoE) / Qwen3.5(-MoE) / GLM-4.1V / GLM-4.5V checkpoints and synthetic
image batches
(test helper, not a test).

Images are built directly in the processor's layout: `pixel_values` (patches, C * temporal_patch * patch * patch)
and `image_grid_thw` (images, 3) in patches; each image then takes t * h * w / merge**2 placeholder tokens.
"""

from __future__ import annotations

import torch

VOCAB = 128
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 118, 119
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe")
_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END)


def hf_config(family: str, *, tie: bool = False):
    """A tiny config: 2 text layers, a 2-block vision tower whose 4x4-patch image merges to 4 tokens."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=PATCH,
                  temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE, out_hidden_size=64)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision.update(window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_IDS)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        if family == "qwen3_vl_moe":        # layer 0 dense (mlp_only_layers), layer 1 sparse
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0])
            return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_IDS)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_IDS)
    if family in ("qwen3_5", "qwen3_5_moe"):        # hybrid layers: gated DeltaNet, then gated attention
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig
        text.update(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                               "mrope_interleaved": True})
        vision.update(num_position_embeddings=16)
        if family == "qwen3_5_moe":
            del text["intermediate_size"]
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24)
            return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_IDS)
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_IDS)
    if family == "glm4v":       # RoPE over half of each head in interleaved pairs; its own image markers
        from transformers import Glm4vConfig
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1]})
        vision.update(image_size=16, rms_norm_eps=1e-5)
        return Glm4vConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, image_token_id=IMAGE,
                           video_token_id=VIDEO, image_start_token_id=VISION_START, image_end_token_id=VISION_END)
    if family == "glm4v_moe":   # GLM-4.5's layers: layer 0 dense, layer 1 sparse (8 experts in 4 groups, top-2 of 2)
        from transformers import Glm4vMoeConfig
        text.update(head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                    moe_intermediate_size=16, n_group=4, topk_group=2, first_k_dense_replace=1,
                    routed_scaling_factor=2.5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1]})
        vision.update(image_size=16, rms_norm_eps=1e-5)
        return Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, image_token_id=IMAGE,
                              video_token_id=VIDEO, image_start_token_id=VISION_START, image_end_token_id=VISION_END)
    raise KeyError(family)


def hf_model(family: str, *, tie: bool = False, seed: int = 0):
    """A random transformers VL model (fp32, eval, sdpa); biases and norms randomised so bugs show."""
    import transformers
    cls = getattr(transformers, {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                 "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                 "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                                 "qwen3_5": "Qwen3_5ForConditionalGeneration",
                                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                                 "glm4v": "Glm4vForConditionalGeneration",
                                 "glm4v_moe": "Glm4vMoeForConditionalGeneration"}[family])
    torch.manual_seed(seed)
    model = cls._from_config(hf_config(family, tie=tie), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_hf(tmp_path, family: str, *, tie: bool = False, seed: int = 0):
    """(directory, model): a random transformers VL model saved with `save_pretrained`."""
    model = hf_model(family, tie=tie, seed=seed)
    path = tmp_path / family
    model.save_pretrained(path)
    return path, model


def image_tokens(grid_thw) -> int:
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // MERGE**2


def ragged_vl_batch(seed: int = 0):
    """(input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids) of 4 rows: text only (left
    padded), one image, two images (right padded too), text only. Images sit between vision start/end tokens."""
    gen = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 4), (1, 4, 6), (1, 6, 4)]                  # rows 1, 2, 2

    def text(n):
        return torch.randint(0, VISION_START, (n,), generator=gen).tolist()

    def image(g):
        return [VISION_START] + [IMAGE] * image_tokens(g) + [VISION_END]

    rows = [text(9), text(3) + image(grids[0]) + text(4), text(2) + image(grids[1]) + text(3) + image(grids[2])
            + text(2), text(13)]
    pads = [(4, 0), (0, 1), (0, 2), (2, 3)]                   # (left, right)
    length = max(len(r) + left + right for r, (left, right) in zip(rows, pads))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (row, (left, _)) in enumerate(zip(rows, pads)):
        ids[b, left:left + len(row)] = torch.tensor(row)
        mask[b, left:left + len(row)] = 1
    grid_thw = torch.tensor(grids)
    patches = int(grid_thw.prod(-1).sum())
    pixel_values = torch.randn(patches, 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=gen)
    return ids, mask, pixel_values, grid_thw, (ids == IMAGE).int()


def text_and_image_prompts(grid_sets, g: torch.Generator, lead) -> tuple[list[list[int]], list[dict | None]]:
    """One prompt per entry of `grid_sets` (a list of (t, h, w) image grids; [] for a text prompt): `lead(g)` text
    tokens, then each image's placeholders between its start/end markers and two text tokens; and each prompt's
    `multi_modal_inputs` (random pixels in the processor's layout), None for a text prompt."""
    def text(n):
        return torch.randint(3, VISION_START, (n,), generator=g).tolist()

    prompts, inputs = [], []
    for grids in grid_sets:
        ids = text(lead(g))
        for grid in grids:
            ids += [VISION_START] + [IMAGE] * image_tokens(grid) + [VISION_END] + text(2)
        prompts.append(ids)
        if grids:
            grid_thw = torch.tensor(grids)
            pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=g)
            inputs.append({"pixel_values": pixels, "image_grid_thw": grid_thw})
        else:
            inputs.append(None)
    return prompts, inputs
