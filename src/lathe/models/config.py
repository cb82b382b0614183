"""The shape of a lathe decoder, read from a Hugging Face `config.json`.

Plain JSON is read (no `AutoConfig`), so both the transformers 4 layout (`rope_theta` plus
`rope_scaling`) and the transformers 5 layout (`rope_parameters`) are understood, and reading a
config never imports transformers. Anything lathe's decoder does not implement raises
`UnsupportedArchitecture`, whose message says that the transformers fallback will be used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lathe.models import quantized
from lathe.models.deepseek_config import MlaConfig
from lathe.models.hybrid_config import HYBRID_ARCHITECTURES, HYBRID_MODEL_TYPES, LinearAttentionConfig, \
    check_hybrid_features
from lathe.models.nemotron_h_config import NemotronConfig

# the hybrid linear-attention families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) are in HYBRID_ARCHITECTURES
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "GptOssForCausalLM", "DeepseekV3ForCausalLM", "MiMoForCausalLM", "MistralForCausalLM",
                           "SeedOssForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "HYV3ForCausalLM",
                           "NemotronHForCausalLM", *HYBRID_ARCHITECTURES}
# The token-classification (critic) heads over the same backbones load too (GLM-4's, GLM-4.5's, HY-V3's and
# Nemotron-H's: the names lathe saves a critic under; transformers has no such classes)
VALUE_ARCHITECTURES = {"LlamaForTokenClassification", "Qwen2ForTokenClassification",
                       "Qwen3ForTokenClassification", "Qwen3MoeForTokenClassification", "GptOssForTokenClassification",
                       "DeepseekV3ForTokenClassification", "MistralForTokenClassification",
                       "SeedOssForTokenClassification", "Glm4ForTokenClassification",
                       "Glm4MoeForTokenClassification",
                       "HYV3ForTokenClassification", "NemotronHForTokenClassification"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "mimo": "MiMoForCausalLM", "mistral": "MistralForCausalLM",
               "seed_oss": "SeedOssForCausalLM", "glm4": "Glm4ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
               "hy_v3": "HYV3ForCausalLM",
               "nemotron_h": "NemotronHForCausalLM", **HYBRID_MODEL_TYPES}
ROPE_TYPES = {"default", "linear", "llama3", "dynamic", "yarn"}
# Families whose main model is exactly Qwen2's (q/k/v bias, no o bias): MiMo is Qwen2 plus its MTP layers
QWEN2_BODIES = ("Qwen2", "MiMo")
# Dropout keys of the families' configs: lathe's decoder has none (an RL update's ratio is taken against a rollout
# without it), so a checkpoint that asks for it runs in transformers, unless override_config sets it to 0
DROPOUT_KEYS = ("attention_dropout", "residual_dropout", "hidden_dropout")


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """(the dictionary, the file's path) of `<path>/config.json`; a clear error when there is none."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no config.json; a Hugging Face checkpoint directory holds "
                                "config.json next to its *.safetensors weights")
    with open(file) as f:
        return json.load(f), str(file)


class UnsupportedArchitecture(ValueError):
    """The checkpoint is outside what lathe's own decoder implements; transformers will run it instead."""


@dataclass
class RopeConfig:
    """Rotary position embedding parameters (the keys of HF's `rope_parameters`)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None                      # linear, llama3, dynamic, yarn
    low_freq_factor: float | None = None             # llama3
    high_freq_factor: float | None = None            # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    attention_factor: float | None = None            # yarn: scales cos/sin
    beta_fast: float | None = None                   # yarn
    beta_slow: float | None = None                   # yarn
    mscale: float | None = None                      # yarn
    mscale_all_dim: float | None = None              # yarn
    truncate: bool = True                            # yarn


@dataclass
class MoeConfig:
    """The mixture-of-experts keys of a Qwen3-MoE `config.json` (`lathe.models.moe` computes the layers); a GPT-OSS
    config's are read into it by `lathe.models.gpt_oss_config` (`lathe.models.gpt_oss` computes those layers)."""

    num_experts: int                   # per sparse layer (`num_experts`; transformers 5 writes `num_local_experts`)
    num_experts_per_tok: int           # top-k experts each token is routed to
    moe_intermediate_size: int         # each expert's SwiGLU width
    norm_topk_prob: bool = False       # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1       # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()   # ... and i is not listed here (those keep a dense MLP)
    router_aux_loss_coef: float = 0.001     # weight of the load-balancing loss (`LatheCausalLM.router_aux_loss`)
    output_router_logits: bool = False      # transformers adds the weighted aux loss to its loss when true
    # GPT-OSS (`lathe.models.gpt_oss`): router and experts with biases, the clamped SwiGLU (alpha, limit), the
    # experts' tensors stored fused on disk too (Qwen3-MoE: one tensor per expert and projection)
    swiglu_alpha: float | None = None       # None: the plain SwiGLU of Qwen3-MoE
    swiglu_limit: float | None = None
    fused_on_disk: bool = False
    # DeepSeek-V3's and GLM-4.5's routing (`lathe.models.deepseek.DeepseekMoeBlock`): sigmoid scores, a selection
    # bias, the top `topk_group` of `n_group` expert groups, the weights times `routed_scaling_factor`, and
    # `n_shared_experts` shared experts of moe_intermediate_size beside the routed ones. "softmax": Qwen3-MoE's top-k
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def is_sparse(self, index: int) -> bool:
        return (index not in self.mlp_only_layers and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MoeConfig":
        experts = d.get("num_experts", d.get("num_local_experts"))
        top_k = int(d.get("num_experts_per_tok") or 0)
        if experts is None or not d.get("moe_intermediate_size") or top_k < 1 or top_k > int(experts):
            raise ValueError(f"a Qwen3-MoE config needs num_experts (or num_local_experts), num_experts_per_tok "
                             f"(1 .. num_experts) and moe_intermediate_size; got num_experts={experts}, "
                             f"num_experts_per_tok={d.get('num_experts_per_tok')}, moe_intermediate_size="
                             f"{d.get('moe_intermediate_size')}. Fix the checkpoint's config.json")
        return cls(num_experts=int(experts), num_experts_per_tok=top_k,
                   moe_intermediate_size=int(d["moe_intermediate_size"]),
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
                   output_router_logits=bool(d.get("output_router_logits", False)))


@dataclass
class LatheConfig:
    """Everything the decoder math needs; `hf_config` keeps the original JSON for saving back."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False        # bias on q/k/v projections (always on for Qwen2)
    o_bias: bool = False          # bias on o_proj (Llama/Qwen3 `attention_bias`)
    mlp_bias: bool = False        # Llama `mlp_bias`
    qk_norm: bool = False         # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe: MoeConfig | None = None  # Qwen3-MoE: the sparse layers' experts and router; None for a dense model
    attention_sinks: bool = False            # GPT-OSS: a learned logit per head in each softmax's denominator
    sliding_window: int | None = None        # the window of the layers `layer_types` names "sliding_attention"
    layer_types: tuple[str, ...] = ()        # per layer: "full_attention" or "sliding_attention"; () = all full
    linear_attention: LinearAttentionConfig | None = None   # Qwen3.5 / Qwen3-Next hybrids; None otherwise
    mla: MlaConfig | None = None             # DeepSeek-V3 family: latent attention, its router; None otherwise
    nemotron: NemotronConfig | None = None   # Nemotron-H: Mamba2 / attention / MLP / MoE layers; None otherwise
    num_mtp_layers: int = 0                  # MiMo: multi-token-prediction layers (`lathe.models.mtp`), HF's
                                             # `num_nextn_predict_layers`; 0 = none
    rope: RopeConfig = field(default_factory=RopeConfig)
    partial_rotary_factor: float = 1.0       # GLM-4, GLM-4.5, the hybrids: RoPE turns the first rotary_dim of a head
    # GLM-4: the checkpoint's q/k heads turn their rotary features in interleaved pairs (x0, x1), (x2, x3), ...;
    # lathe's modules hold them permuted to RoPE's halves layout, as its other models (`lathe.models.glm4`), and the
    # checkpoint I/O permutes them (`io.module_layout` / `io.hub_layout`)
    rope_interleave: bool = False
    post_norms: bool = False                 # GLM-4: an RMSNorm on the attention's and the MLP's outputs too
    torch_dtype: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # the language model of a vision-language checkpoint, run alone (`lathe.models.vl.load_language_model`): that
    # checkpoint's directory and config.json, so that a save writes the whole model back (`io.save_pretrained`)
    vl_checkpoint: tuple[str, dict[str, Any]] | None = field(default=None, repr=False)
    # a checkpoint directory whose multi-token-prediction layers lathe's decoder does not run (DeepSeek-V3's, GLM-4.5's,
    # HY-V3's, the hybrids'), copied unchanged into every checkpoint this model saves (`io.stacked_mtp_tensors`;
    # `actor_rollout_ref.model.mtp.enable=true`); None: saves leave them out
    mtp_source: str | None = field(default=None, repr=False)

    @property
    def rotary_dim(self) -> int:
        """The features of each query and key head that RoPE turns (the first ones; the rest pass unturned)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def stacked_mtp_layers(self) -> bool:
        """Whether the checkpoint may hold multi-token-prediction layers as `model.layers.<n>` past the decoder's
        (DeepSeek-V3, GLM-4.5, HY-V3): neither lathe's decoder nor transformers runs them (`io.load_into` drops
        them)."""
        return self.mla is not None or self.family in ("glm4moe", "hyv3")

    @property
    def family(self) -> str:
        return self.architecture.replace("ForCausalLM", "").replace("ForTokenClassification", "").lower()

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` is a mixture-of-experts layer (else a dense MLP of `intermediate_size`)."""
        return self.moe is not None and self.moe.is_sparse(index)

    @property
    def sinks_or_windows(self) -> bool:
        """Whether some layer hands its attention sinks or a sliding window (GPT-OSS), which only some of lathe's
        attentions implement (`lathe.models.attention`)."""
        return self.attention_sinks or any(self.window_of(i) is not None for i in range(self.num_hidden_layers))

    def window_of(self, index: int) -> int | None:
        """The sliding window of layer `index` (a query sees itself and the window - 1 tokens before it), or None."""
        if self.layer_types and self.layer_types[index] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "LatheConfig":
        """Read `<path>/config.json`."""
        d, source = read_config_json(path)
        return cls.from_hf_dict(d, source=source)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "LatheConfig":
        """Build from a Hugging Face config dictionary; raise `UnsupportedArchitecture` for what lathe lacks."""
        arch = _architecture(d, source)
        family = arch.replace("ForCausalLM", "").replace("ForTokenClassification", "")
        hybrid = arch in HYBRID_ARCHITECTURES
        if hybrid:
            check_hybrid_features(d, arch, source)
        elif not arch.startswith(("DeepseekV3", "NemotronH")):     # their own checks (their `*_config` modules)
            _check_features(d, arch, source)
        _check_dropout(d, arch, source)
        raw = d                             # (saved back as it was)
        if family == "HYV3":                # transformers' defaults for the keys its config.json leaves out
            from lathe.models.deepseek_config import HYV3_DEFAULTS, refuse_hy_v3_features
            d = {**HYV3_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
            refuse_hy_v3_features(d, source)
        heads, glm = int(d["num_attention_heads"]), family == "Glm4Moe"
        glm4 = family == "Glm4"
        attention_bias = bool(d.get("attention_bias", family in ("SeedOss", "Glm4")))     # (transformers' defaults)
        window, layer_types = _mistral_window(d, family)
        if family == "GptOss":
            from lathe.models.gpt_oss_config import gpt_oss_fields
            return cls(architecture=arch, **gpt_oss_fields(d, source), hf_config=dict(d))
        if family == "DeepseekV3":
            from lathe.models.deepseek_config import deepseek_fields
            return cls(architecture=arch, **deepseek_fields(d, source), hf_config=dict(d))
        if family == "NemotronH":
            from lathe.models.nemotron_h_config import nemotron_fields
            return cls(architecture=arch, **nemotron_fields(d, source), hf_config=dict(d))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size") or d["moe_intermediate_size"]),   # (Qwen3.5-MoE: none)
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            # (transformers' GLM-4 config defaults head_dim to 128)
            head_dim=int(d.get("head_dim") or (128 if glm4 else int(d["hidden_size"]) // heads)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if family in QWEN2_BODIES else attention_bias and family != "Mistral",
            o_bias=(bool(d.get("attention_out_bias", False)) if family == "SeedOss"
                    else False if family in QWEN2_BODIES + ("Mistral", "Glm4", "Glm4Moe") else attention_bias),
            mlp_bias=bool(d.get("mlp_bias", False)) if family in ("Llama", "SeedOss") else False,
            sliding_window=window, layer_types=layer_types,
            qk_norm=family in ("Qwen3", "Qwen3Moe", "HYV3") or hybrid or glm and bool(d.get("use_qk_norm", False)),
            moe=MoeConfig.from_hf_dict(_hybrid_moe_dict(d, arch)) if family in ("Qwen3Moe", "Qwen3_5Moe", "Qwen3Next")
            else _glm_moe(d, source) if glm else _hy_moe(d, source) if family == "HYV3" else None,
            # (others: 1, `_check_features`)
            partial_rotary_factor=_partial_rotary_factor(d, 0.5 if glm or glm4 else 1.0),
            rope_interleave=glm4, post_norms=glm4,
            linear_attention=LinearAttentionConfig.from_hf_dict(d, arch, source) if hybrid else None,
            num_mtp_layers=int(d.get("num_nextn_predict_layers") or 0) if family == "MiMo" else 0,
            rope=read_rope(d, source),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            hf_config=dict(raw),
        )


def _partial_rotary_factor(d: dict[str, Any], default: float) -> float:
    """The share of each head RoPE turns: `rope_parameters.partial_rotary_factor` (transformers 5), the top-level key
    (4.x), else the family's default (GLM-4's and GLM-4.5's 0.5, as transformers sets it for configs without the key;
    1)."""
    prf = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
    prf = default if prf is None else float(prf)
    if not 0.0 < prf <= 1.0:
        raise ValueError(f"partial_rotary_factor={prf}: the share of each head RoPE turns lies in (0, 1]. Fix "
                         "config.json")
    return prf


def _glm_moe(d: dict[str, Any], source: str) -> MoeConfig:
    from lathe.models.deepseek_config import GLM4_MOE_DEFAULTS, group_routed_moe
    return group_routed_moe(d, GLM4_MOE_DEFAULTS, int(d["num_hidden_layers"]), source)


def _hy_moe(d: dict[str, Any], source: str) -> MoeConfig:
    from lathe.models.deepseek_config import hy_v3_moe
    return hy_v3_moe(d, int(d["num_hidden_layers"]), source)


def _check_dropout(d: dict[str, Any], arch: str, source: str) -> None:
    """Refuse a config with dropout: transformers applies it in a training-mode forward, lathe's decoder never."""
    on = {k: d[k] for k in DROPOUT_KEYS if float(d.get(k) or 0.0) > 0.0}
    if on:
        keys = ", ".join(f"{k}={v}" for k, v in on.items())
        zero = " and ".join(f"override_config.{k}=0.0" for k in on)
        raise UnsupportedArchitecture(f"{source}: {arch} with {keys} (lathe's decoder has no dropout: set {zero} "
                                      "under actor_rollout_ref.model (critic.model for a critic) to run it there, as "
                                      "verl's scripts often do); the transformers fallback will be used")


def _mistral_window(d: dict[str, Any], family: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a Mistral config: its `sliding_window` (transformers' Mistral masks every
    layer so when it is set; Mistral-7B-v0.1 4096, later releases null), else full attention."""
    window = d.get("sliding_window") if family == "Mistral" else None
    if not window:
        return None, ()
    return int(window), ("sliding_attention",) * int(d["num_hidden_layers"])


def _hybrid_moe_dict(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen3.5-MoE's router always renormalises its top-k weights, and all its layers are sparse (no such keys)."""
    return {**d, "norm_topk_prob": True} if arch == "Qwen3_5MoeForCausalLM" else d


def _architecture(d: dict[str, Any], source: str) -> str:
    archs = d.get("architectures") or []
    if not archs:
        model_type = d.get("model_type")
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type]
        raise UnsupportedArchitecture(f"{source}: no 'architectures' entry and model_type={model_type!r}; lathe's "
                                      "decoder cannot tell what this is, so the transformers fallback will be used")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES | VALUE_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{source}: architecture {arch!r} is not implemented by lathe's decoder (supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}); the transformers fallback will be used")
    return arch


def _check_features(d: dict[str, Any], arch: str, source: str) -> None:
    """Refuse configs whose math lathe's decoder does not reproduce."""
    fallback = "; the transformers fallback will be used"
    quantized.scheme(d, source)         # (a scheme lathe reads is dequantised as the weights load)
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{source}: {arch} with hidden_act={act!r} (lathe implements silu){fallback}")
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise UnsupportedArchitecture(f"{source}: {arch} with use_sliding_window=true (lathe implements full "
                                      f"attention only){fallback}")
    layer_types = d.get("layer_types") or []
    allowed = {"full_attention", "sliding_attention"} if arch.startswith("GptOss") else {"full_attention"}
    if any(t not in allowed for t in layer_types):
        raise UnsupportedArchitecture(f"{source}: {arch} with layer_types other than {' or '.join(sorted(allowed))}"
                                      f"{fallback}")
    prf = d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
    if prf not in (None, 1, 1.0) and not arch.startswith("Glm4"):       # (GLM-4's, GLM-4.5's: `LatheConfig.rotary_dim`)
        raise UnsupportedArchitecture(f"{source}: {arch} with partial_rotary_factor={prf}{fallback}")


def read_rope(d: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """RoPE parameters from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitecture(f"{source}: rope_type={rope_type!r} is not implemented by lathe's decoder "
                                      f"(supported: {', '.join(sorted(ROPE_TYPES))}); the transformers fallback "
                                      "will be used")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    orig = params.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = d.get("max_position_embeddings", 2048)
    rope = RopeConfig(rope_type=rope_type, rope_theta=float(theta),
                      original_max_position_embeddings=int(orig) if orig is not None else None,
                      truncate=bool(params.get("truncate", True)))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            setattr(rope, key, float(params[key]))
    needs = {"linear": ["factor"], "dynamic": ["factor"],
             "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}.get(rope_type, [])
    missing = [k for k in needs if getattr(rope, k) is None]
    if missing:
        raise ValueError(f"{source}: rope_type={rope_type!r} needs {', '.join(missing)} in rope_scaling / "
                         "rope_parameters; add them (see the model card) or remove the scaling")
    return rope
