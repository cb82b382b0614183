"""Reading a GPT-OSS `config.json` (`model_type: gpt_oss`) into the fields of `LatheConfig`; kept apart from
`config.py` so that each family's keys are read in one place.

GPT-OSS (OpenAI, 2025; transformers' `GptOssConfig`): every layer's MLP is a mixture of experts of width
`intermediate_size` (`num_local_experts`, top `num_experts_per_tok`), router and experts with biases, the clamped
SwiGLU (`swiglu_alpha`, `swiglu_limit`); attention with biases on all four projections, a learned sink logit per head,
and `layer_types` alternating sliding-window (`sliding_window`) and full attention; YaRN RoPE.

Real checkpoints ship their experts quantised to MXFP4 (`quantization_config.quant_method: mxfp4`); lathe reads the
bfloat16 layout transformers writes once they are dequantised (`lathe.models.quantized` refuses MXFP4 and says how
to get it).
"""

from __future__ import annotations

from typing import Any

FALLBACK = "; the transformers fallback will be used"
# transformers' `GptOssConfig` defaults, for a config.json that leaves RoPE out
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The `LatheConfig` keyword arguments of a GPT-OSS config (all but architecture and hf_config)."""
    from lathe.models.config import MoeConfig, UnsupportedArchitecture, read_rope
    heads, layers = int(d["num_attention_heads"]), int(d["num_hidden_layers"])
    experts = d.get("num_local_experts", d.get("num_experts"))
    top_k = int(d.get("num_experts_per_tok") or 0)
    if experts is None or top_k < 1 or top_k > int(experts):
        raise ValueError(f"{source}: a GPT-OSS config needs num_local_experts and num_experts_per_tok (1 .. "
                         f"num_local_experts); got {experts} and {d.get('num_experts_per_tok')}. Fix the "
                         "checkpoint's config.json")
    layer_types = tuple(d.get("layer_types") or ("sliding_attention" if (i + 1) % 2 else "full_attention"
                                                  for i in range(layers)))
    window = d.get("sliding_window")
    if len(layer_types) != layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers; fix config.json")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedArchitecture(f"{source}: sliding_attention layers without a sliding_window{FALLBACK}")
    inter = int(d["intermediate_size"])
    moe = MoeConfig(num_experts=int(experts), num_experts_per_tok=top_k, moe_intermediate_size=inter,
                    norm_topk_prob=True,        # a softmax over the top-k logits is the renormalised top-k softmax
                    router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
                    output_router_logits=bool(d.get("output_router_logits", False)),
                    swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                    fused_on_disk=True)
    bias = bool(d.get("attention_bias", True))
    return dict(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]), intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bias, o_bias=bias, moe=moe, attention_sinks=True,
                sliding_window=int(window) if window else None, layer_types=layer_types,
                torch_dtype=d.get("dtype") or d.get("torch_dtype"), rope=read_rope(_rope_defaults(d), source))


def _rope_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with transformers' GPT-OSS RoPE defaults where it has none (YaRN, theta 150000)."""
    params = d.get("rope_parameters") or d.get("rope_scaling")
    theta = (params or {}).get("rope_theta", d.get("rope_theta", DEFAULT_THETA))
    return {**d, "rope_parameters": {**(params or DEFAULT_ROPE), "rope_theta": theta}}
