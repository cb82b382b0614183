"""The shape of a Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3.5-MoE / GLM-4.1V / GLM-4.5V checkpoint, read from its plain
`config.json`.

Both layouts are read: transformers 5 (`text_config` / `vision_config` sub-dictionaries) and the flat 4.x layout
of the early Qwen2.5-VL releases (text keys at the top level, `rope_scaling: {"type": "mrope", ...}`). The language
model becomes a `LatheConfig` for lathe's decoder layers (Qwen3.5's: the hybrid gated-DeltaNet / gated-attention
layers of `lathe.models.qwen3_5`, as its text-only checkpoints); the vision part stays a dictionary, handed to
transformers' own vision-tower class (`lathe.models.vl.vision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lathe.models.config import LatheConfig, MoeConfig, UnsupportedArchitecture, _partial_rotary_factor, \
    read_config_json, read_rope

# architecture -> family; Qwen3-VL interleaves the M-RoPE axes over the rotary dims, Qwen2.5-VL splits them in blocks
VL_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                    "Qwen3VLForConditionalGeneration": "qwen3_vl",
                    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
                    "Qwen3_5ForConditionalGeneration": "qwen3_5",
                    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
                    "Glm4vForConditionalGeneration": "glm4v",
                    "Glm4vMoeForConditionalGeneration": "glm4v_moe"}
_MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
                "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                "glm4v": "Glm4vForConditionalGeneration", "glm4v_moe": "Glm4vMoeForConditionalGeneration"}
# the Qwen3.5 families' language models: lathe's hybrid decoder layers, read as their text-only checkpoints are
HYBRID_TEXT = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
# ... and GLM-4.5V's: GLM-4.5's layers (partial RoPE, DeepSeek-V3's MoE), read as its text checkpoints are
TEXT_ARCHITECTURES = {**HYBRID_TEXT, "glm4v_moe": "Glm4MoeForCausalLM"}
INTERLEAVED = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")   # M-RoPE axes interleaved over rotary dims
QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe")              # Qwen3-style attention (q/k norms), deepstack features
_DEFAULT_SECTION = {"qwen3_vl": [24, 20, 20], "qwen3_vl_moe": [24, 20, 20], "qwen3_5": [11, 11, 10],
                    "qwen3_5_moe": [11, 11, 10], "glm4v": [8, 12, 12], "glm4v_moe": [8, 12, 12]}
_DEFAULT_THETA = {"qwen2_5_vl": 1000000.0, "qwen3_vl": 5000000.0, "qwen3_vl_moe": 5000000.0, "qwen3_5": 10000.0,
                  "qwen3_5_moe": 10000.0, "glm4v": 10000.0, "glm4v_moe": 10000.0}
_FALLBACK = "; the transformers fallback will be used"


@dataclass
class VLConfig:
    """What the VL model needs: the text decoder's `LatheConfig`, the vision dictionary and the special tokens."""

    architecture: str
    family: str                      # VL_ARCHITECTURES' values: "qwen2_5_vl", "qwen3_vl", ..., "glm4v_moe"
    text: LatheConfig
    vision: dict[str, Any]
    mrope_section: list[int]         # rotary half-dims given to the (temporal, height, width) position axes
    mrope_interleaved: bool          # Qwen3-VL, Qwen3.5: axes interleaved (T H W T H W ...); Qwen2.5-VL: blocks
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vision.get("spatial_merge_size", 2))

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "VLConfig":
        """Read `<path>/config.json`."""
        d, source = read_config_json(path)
        return cls.from_hf_dict(d, source=source)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "VLConfig":
        """Build from a transformers config dictionary; raise `UnsupportedArchitecture` for what lathe lacks."""
        arch = (d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type"), "")])[0]
        if arch not in VL_ARCHITECTURES:
            raise UnsupportedArchitecture(f"{source}: architecture {arch!r} is not a vision-language model lathe "
                                          f"implements (supported: {', '.join(sorted(VL_ARCHITECTURES))}){_FALLBACK}")
        family = VL_ARCHITECTURES[arch]
        text = dict(d.get("text_config") or d)          # flat 4.x layout: the text keys sit at the top level
        vision = dict(d.get("vision_config") or {})
        if not vision:
            raise ValueError(f"{source}: {arch} without 'vision_config'; the checkpoint's config.json is incomplete "
                             "(re-save it with transformers' save_pretrained)")
        params = dict(text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_parameters")
                      or d.get("rope_scaling") or {})
        if "rope_theta" not in params:      # transformers' defaults of each family
            params["rope_theta"] = text.get("rope_theta", d.get("rope_theta", _DEFAULT_THETA[family]))
        # (where a config names no sections, transformers' rotary embeddings fall back to these)
        section = params.pop("mrope_section", _DEFAULT_SECTION.get(family))
        params.pop("mrope_interleaved", None)
        if (params.get("rope_type") or params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        if not section or len(section) != 3:
            raise ValueError(f"{source}: {arch} needs rope_parameters.mrope_section, three ints (temporal, height, "
                             f"width rotary half-dims), got {section!r}; copy it from the model card's config.json")
        text_cfg = (_hybrid_text_config(text, family, params, source) if family in TEXT_ARCHITECTURES
                    else _text_config(text, family, arch, params, source))
        _check_section(section, text_cfg.rotary_dim, family, source)
        # the top-level key decides where there is one, as transformers reads it (Qwen3-VL-MoE's text config
        # defaults to tied beside an untied model)
        tie = bool(d["tie_word_embeddings"] if "tie_word_embeddings" in d else text.get("tie_word_embeddings", False))
        text_cfg.tie_word_embeddings = tie
        return cls(architecture=arch, family=family, text=text_cfg, vision=vision,
                   mrope_section=[int(s) for s in section], mrope_interleaved=family in INTERLEAVED,
                   image_token_id=int(d["image_token_id"]),
                   video_token_id=int(d.get("video_token_id", -1)),
                   vision_start_token_id=d.get("vision_start_token_id"), tie_word_embeddings=tie,
                   torch_dtype=d.get("dtype") or d.get("torch_dtype") or text.get("dtype"), hf_config=dict(d))


def _text_config(t: dict[str, Any], family: str, arch: str, rope_params: dict, source: str) -> LatheConfig:
    """The language model as lathe's decoder sees it: Qwen2-style (q/k/v bias), Qwen3-style (q/k norm) or GLM-4's
    (q/k/v bias, RoPE over `partial_rotary_factor` of each head in interleaved pairs, norms on the attention's and
    MLP's outputs: `lathe.models.glm4`)."""
    act = t.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{source}: {arch} with text hidden_act={act!r} (lathe implements silu)"
                                      f"{_FALLBACK}")
    if t.get("use_sliding_window") and t.get("sliding_window"):
        raise UnsupportedArchitecture(f"{source}: {arch} with use_sliding_window=true (lathe implements full "
                                      f"attention only){_FALLBACK}")
    if any(k != "full_attention" for k in t.get("layer_types") or []):
        raise UnsupportedArchitecture(f"{source}: {arch} with layer_types other than full_attention{_FALLBACK}")
    rope = read_rope({"rope_parameters": rope_params, "max_position_embeddings": t.get("max_position_embeddings")},
                     source)
    if rope.rope_type == "dynamic":
        raise UnsupportedArchitecture(f"{source}: {arch} with rope_type='dynamic' (lathe's M-RoPE implements "
                                      f"fixed frequencies){_FALLBACK}")
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    qwen3 = family in QWEN3_VL
    # Qwen3-VL-MoE's router always renormalises its top-k weights (transformers' Qwen3VLMoeTextTopKRouter)
    moe = MoeConfig.from_hf_dict({**t, "norm_topk_prob": True}) if family == "qwen3_vl_moe" else None
    bias = bool(t.get("attention_bias", False))
    return LatheConfig(
        architecture=arch, vocab_size=int(t["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(t.get("intermediate_size") or t["moe_intermediate_size"]), num_hidden_layers=int(t["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        # Qwen2.5-VL ignores a head_dim key (always hidden / heads); Qwen3-VL reads it (default 128)
        head_dim=int(t.get("head_dim", 128)) if qwen3 else hidden // heads,
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        qkv_bias=bias if qwen3 else True, o_bias=bias if qwen3 else False, qk_norm=qwen3, rope=rope, moe=moe,
        # (GLM-4.1V's, where its config gives one; 1 otherwise, as transformers reads it)
        partial_rotary_factor=_partial_rotary_factor({**t, "rope_parameters": rope_params}, 1.0),
        rope_interleave=family == "glm4v", post_norms=family == "glm4v",
        torch_dtype=t.get("dtype") or t.get("torch_dtype"), hf_config=dict(t))


def _hybrid_text_config(t: dict[str, Any], family: str, rope_params: dict, source: str) -> LatheConfig:
    """Qwen3.5's language model as its text-only checkpoint (`Qwen3_5ForCausalLM`) reads: lathe's hybrid layers,
    the rotary embedding over each head's `partial_rotary_factor` (M-RoPE's sections count its half-dims); GLM-4.5V's
    as GLM-4.5's (`Glm4MoeForCausalLM`)."""
    arch = TEXT_ARCHITECTURES[family]
    d = {**t, "architectures": [arch], "rope_parameters": {**rope_params, "rope_type": "default"}
         if (rope_params.get("rope_type") or "default") == "default" else rope_params}
    d.pop("vision_config", None)
    return LatheConfig.from_hf_dict(d, source=source)


def _check_section(section: list[int], rotary_dim: int, family: str, source: str) -> None:
    half = rotary_dim // 2
    if family in ("qwen2_5_vl", "glm4v", "glm4v_moe") and sum(section) != half:
        raise ValueError(f"{source}: mrope_section {section} must sum to the rotary dims / 2 = {half}; fix "
                         "rope_parameters.mrope_section (or partial_rotary_factor)")
    # interleaved: the height axis takes half-dims 1, 4, ..., the width axis 2, 5, ..., section[axis] of each
    if family in INTERLEAVED and any(3 * (section[a] - 1) + a >= half for a in (1, 2) if section[a]):
        raise ValueError(f"{source}: interleaved mrope_section {section} needs 3 * (n - 1) + axis < rotary dims / 2 "
                         f"= {half} for the height (axis 1) and width (axis 2) sections; fix "
                         "rope_parameters.mrope_section")
