"""Reading a DeepSeek-V3 family `config.json` (`model_type: deepseek_v3`: DeepSeek-V3, Moonlight, Kimi-K2) into the
fields of `LatheConfig`; `lathe.models.deepseek` computes its layers.

The keys (transformers' `DeepseekV3Config`, whose defaults a config.json that leaves a key out gets):
- multi-head latent attention: `q_lora_rank` (null: a plain `q_proj`), `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`, `attention_bias`;
- its MoE: `n_routed_experts` top `num_experts_per_tok` of width `moe_intermediate_size`, `n_shared_experts`,
  `n_group` / `topk_group` (group-limited routing), `norm_topk_prob`, `routed_scaling_factor`, and dense layers
  (`intermediate_size`) before `first_k_dense_replace`.

In `LatheConfig` the attention looks like plain multi-head attention to the rest of lathe (the trainer's attention
callables): `num_key_value_heads` = the query heads and `head_dim` = the padded per-head width
max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim) the attention callables see (`MlaConfig.attn_dim`). The engine's
paged cache holds each token's latent instead (`MlaConfig.latent_dim`, `lathe.engine.mla.cache_layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ARCHITECTURE = "DeepseekV3ForCausalLM"
FALLBACK = "; the transformers fallback will be used"
# transformers' `DeepseekV3Config` defaults, for keys a config.json leaves out
DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_interleave": True, "attention_bias": False}

# transformers' `Glm4MoeConfig` defaults of its MoE keys (GLM-4.5, GLM-4.5-Air, GLM-4.6: `lathe.models.config`)
GLM4_MOE_DEFAULTS = {"n_routed_experts": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 1408, "norm_topk_prob": True, "first_k_dense_replace": 1,
                     "routed_scaling_factor": 1.0, "n_shared_experts": 1}

# transformers' `HYV3Config` defaults (HY-V3: Tencent's Hy3), for keys a config.json leaves out
HYV3_DEFAULTS = {"vocab_size": 120832, "hidden_size": 4096, "intermediate_size": 13312, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 11158840.0,
                 "num_experts": 192, "num_experts_per_tok": 8, "num_shared_experts": 1, "moe_intermediate_size": 1536,
                 "router_scaling_factor": 2.826, "attention_bias": False, "mlp_bias": False}


@dataclass
class MlaConfig:
    """The DeepSeek-V3 family's own keys (module doc): the latent attention's shape and the router's variant."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float            # qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The per-token width of the engine's latent cache (`lathe.engine.mla`): the normed latent and the rotated
        rope part of k, shared by every head, up to a multiple of 8."""
        return -(-(self.kv_lora_rank + self.qk_rope_head_dim) // 8) * 8

    @property
    def attn_dim(self) -> int:
        """The per-head width of q, k and v as the attention callables and the KV cache see them (the shorter of
        q/k and v zero-padded to the longer, and both up to a multiple of 8: flash attention's kernels take no
        other head size; DeepSeek-V3's and Moonlight's 192 already is one)."""
        return -(-max(self.qk_head_dim, self.v_head_dim) // 8) * 8


def _get(d: dict[str, Any], key: str):
    return d[key] if key in d else DEFAULTS[key]


def refuse_deepseek_features(d: dict[str, Any], source: str) -> None:
    """Raise `UnsupportedArchitecture` for what lathe's DeepSeek-V3 layers do not compute."""
    from lathe.models.config import UnsupportedArchitecture
    from lathe.models import quantized
    quantized.scheme(d, source)         # (DeepSeek-V3's and Kimi-K2's block-FP8 weights are read dequantised)
    checks = {"hidden_act": ("silu", d.get("hidden_act", "silu")),
              "scoring_func": ("sigmoid", d.get("scoring_func", "sigmoid")),
              "topk_method": ("noaux_tc", d.get("topk_method", "noaux_tc"))}
    for key, (want, got) in checks.items():
        if got != want:
            raise UnsupportedArchitecture(f"{source}: {ARCHITECTURE} with {key}={got!r} (lathe implements "
                                          f"{want!r}, as transformers' DeepseekV3 does){FALLBACK}")
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if kv is not None and heads is not None and int(kv) != int(heads):
        raise UnsupportedArchitecture(f"{source}: {ARCHITECTURE} with num_key_value_heads={kv} != num_attention_heads="
                                      f"{heads} (the latent attention expands K/V to every query head){FALLBACK}")


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """transformers' DeepseekV3 softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 (YaRN's
    0.1 * m * ln(factor) + 1) when the RoPE is scaled and `mscale_all_dim` is set."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


def deepseek_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The `LatheConfig` keyword arguments of a DeepSeek-V3 config (all but architecture and hf_config)."""
    from lathe.models.config import read_rope
    refuse_deepseek_features(d, source)
    heads, layers = int(_get(d, "num_attention_heads")), int(_get(d, "num_hidden_layers"))
    q_lora = _get(d, "q_lora_rank")
    rope_params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    mla = MlaConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(_get(d, "kv_lora_rank")),
                    qk_nope_head_dim=int(_get(d, "qk_nope_head_dim")),
                    qk_rope_head_dim=int(_get(d, "qk_rope_head_dim")),
                    v_head_dim=int(_get(d, "v_head_dim")), rope_interleave=bool(_get(d, "rope_interleave")),
                    softmax_scale=0.0)
    mla.softmax_scale = softmax_scale(mla.qk_head_dim, rope_params)
    moe = group_routed_moe(d, DEFAULTS, layers, source)
    bias = bool(_get(d, "attention_bias"))
    return dict(vocab_size=int(_get(d, "vocab_size")), hidden_size=int(_get(d, "hidden_size")),
                intermediate_size=int(_get(d, "intermediate_size")), num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=mla.attn_dim,
                max_position_embeddings=int(_get(d, "max_position_embeddings")),
                rms_norm_eps=float(_get(d, "rms_norm_eps")), tie_word_embeddings=bool(d.get("tie_word_embeddings")),
                qkv_bias=bias, o_bias=bias, moe=moe, mla=mla, rope=read_rope(d, source),
                torch_dtype=d.get("dtype") or d.get("torch_dtype"))


def group_routed_moe(d: dict[str, Any], defaults: dict[str, Any], layers: int, source: str):
    """The `MoeConfig` of a DeepSeek-V3-style MoE (DeepSeek-V3, GLM-4.5): `n_routed_experts` experts in `n_group`
    groups, sigmoid scores, dense layers before `first_k_dense_replace`; `defaults`: the family's transformers
    defaults for keys the config leaves out. transformers adds no load-balancing loss for these (the aux-free bias
    balances the experts), so neither does lathe: output_router_logits is read as off."""
    from lathe.models.config import MoeConfig

    def get(key):
        return d[key] if key in d else defaults[key]
    experts = int(d.get("n_routed_experts") or d.get("num_local_experts") or defaults["n_routed_experts"])
    groups, top_groups, top_k = int(get("n_group") or 1), int(get("topk_group") or 1), int(get("num_experts_per_tok"))
    if experts % groups or experts // groups < 2 or top_groups > groups or not 1 <= top_k <= experts:
        raise ValueError(f"{source}: n_routed_experts={experts} must split into n_group={groups} groups of 2 or more "
                         f"experts, topk_group={top_groups} must be at most n_group and num_experts_per_tok={top_k} "
                         f"1 .. n_routed_experts. Fix config.json")
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=int(get("moe_intermediate_size")),
                     norm_topk_prob=bool(get("norm_topk_prob")),
                     mlp_only_layers=tuple(range(min(int(get("first_k_dense_replace") or 0), layers))),
                     scoring="sigmoid", n_group=groups, topk_group=top_groups,
                     routed_scaling_factor=float(get("routed_scaling_factor")),
                     n_shared_experts=int(get("n_shared_experts") or 0))


def refuse_hy_v3_features(d: dict[str, Any], source: str) -> None:
    """HY-V3 with `mlp_bias` (biases on its dense and shared experts' projections; Hy3 as released has none): lathe's
    shared experts and their tensor-parallel cuts take no bias."""
    from lathe.models.config import UnsupportedArchitecture
    if d.get("mlp_bias"):
        raise UnsupportedArchitecture(f"{source}: HYV3ForCausalLM with mlp_bias=true (lathe's decoder runs HY-V3's "
                                      f"MLPs and shared experts without biases){FALLBACK}")


def hy_v3_moe(d: dict[str, Any], layers: int, source: str):
    """The `MoeConfig` of an HY-V3 config (`HYV3_DEFAULTS` merged in): DeepSeek-V3's sigmoid routing without expert
    groups, the top-k weights always renormalised and times `router_scaling_factor`, `num_shared_experts` shared
    experts, and the dense layers those `mlp_layer_types` names "dense" (transformers' default: the first alone).
    `enable_moe_fp32_combine` (the shared and routed outputs added in float32, then rounded) is what adding two
    bfloat16 tensors does anyway (torch adds in float32 and rounds once), so both of its values run as they are."""
    from lathe.models.config import MoeConfig
    experts, top_k = int(d.get("num_experts") or d.get("num_local_experts")), int(d["num_experts_per_tok"])
    kinds = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(kinds) != layers or set(kinds) - {"dense", "sparse"} or not 1 <= top_k <= experts:
        raise ValueError(f"{source}: mlp_layer_types must name each of the {layers} layers 'dense' or 'sparse' (got "
                         f"{kinds}) and num_experts_per_tok={top_k} lie in 1 .. num_experts={experts}. Fix config.json")
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=True,
                     mlp_only_layers=tuple(i for i, kind in enumerate(kinds) if kind == "dense"), scoring="sigmoid",
                     routed_scaling_factor=float(d["router_scaling_factor"]),
                     n_shared_experts=int(d.get("num_shared_experts") or 0))
