"""The hybrid linear-attention keys of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next `config.json` (torch-free, like
`lathe.models.config`; `lathe.models.qwen3_5` computes the layers).

These families interleave gated-DeltaNet layers (`layer_types` entry `linear_attention`) with gated full attention
(`full_attention`); their norms are zero-centred ((1 + w) * x / rms(x)), RoPE turns only the first
`partial_rotary_factor` of each head (`LatheConfig.rotary_dim`), and their MoE layers (Qwen3.5-MoE, Qwen3-Next) add a sigmoid-gated shared
expert to the routed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture -> how the gated-DeltaNet input projections are laid out in the checkpoint
HYBRID_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "split",          # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    "Qwen3_5MoeForCausalLM": "split",
    "Qwen3NextForCausalLM": "grouped",      # in_proj_qkvz, in_proj_ba, interleaved per key head
}
HYBRID_MODEL_TYPES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                      "qwen3_next": "Qwen3NextForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class LinearAttentionConfig:
    """Everything the hybrid layers add to a `LatheConfig`."""

    layer_types: tuple[str, ...]            # per decoder layer: linear_attention | full_attention
    projections: str                        # "split" (Qwen3.5) | "grouped" (Qwen3-Next), `HYBRID_ARCHITECTURES`
    num_key_heads: int                      # linear_num_key_heads
    num_value_heads: int                    # linear_num_value_heads (a multiple of the key heads)
    key_head_dim: int                       # linear_key_head_dim
    value_head_dim: int                     # linear_value_head_dim
    conv_kernel: int = 4                    # linear_conv_kernel_dim: the short causal depthwise convolution
    shared_expert_intermediate_size: int = 0    # MoE layers: the shared expert's width (0: none)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], arch: str, source: str) -> "LinearAttentionConfig":
        n = int(d["num_hidden_layers"])
        types = tuple(d.get("layer_types") or ())
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{source}: {arch} needs layer_types with one of {', '.join(LAYER_TYPES)} per layer "
                             f"({n} layers); got {list(types)}. Fix the checkpoint's config.json")
        kh, vh = int(d["linear_num_key_heads"]), int(d["linear_num_value_heads"])
        if vh % kh:
            raise ValueError(f"{source}: linear_num_value_heads={vh} is not a multiple of linear_num_key_heads={kh}")
        return cls(layer_types=types, projections=HYBRID_ARCHITECTURES[arch], num_key_heads=kh, num_value_heads=vh,
                   key_head_dim=int(d["linear_key_head_dim"]), value_head_dim=int(d["linear_value_head_dim"]),
                   conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
                   shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0))


def check_hybrid_features(d: dict[str, Any], arch: str, source: str) -> None:
    """Refuse what lathe's hybrid layers do not reproduce (the transformers fallback then runs the model)."""
    from lathe.models.config import UnsupportedArchitecture
    fallback = "; the transformers fallback will be used"
    from lathe.models import quantized
    quantized.scheme(d, source)
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(f"{source}: {arch} with hidden_act={d.get('hidden_act')!r} (lathe implements "
                                      f"silu){fallback}")
    rope = d.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default":
        raise UnsupportedArchitecture(f"{source}: {arch} with rope_type={rope.get('rope_type')!r} (lathe's hybrid "
                                      f"layers implement the default RoPE){fallback}")
    if rope.get("mrope_section") and d.get("vision_config"):
        raise UnsupportedArchitecture(f"{source}: {arch} with a vision tower{fallback}")
