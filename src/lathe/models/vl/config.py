"""The shape of a Qwen2.5-VL / Qwen3-VL checkpoint, read from its plain `config.json`.

Both layouts are read: transformers 5 (`text_config` / `vision_config` sub-dictionaries) and the flat 4.x layout
of the early Qwen2.5-VL releases (text keys at the top level, `rope_scaling: {"type": "mrope", ...}`). The language
model becomes a `LatheConfig` for lathe's decoder layers; the vision part stays a dictionary, handed to
transformers' own vision-tower class (`lathe.models.vl.vision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lathe.models.config import LatheConfig, UnsupportedArchitecture, read_config_json, read_rope

# architecture -> family; Qwen3-VL interleaves the M-RoPE axes over the rotary dims, Qwen2.5-VL splits them in blocks
VL_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                    "Qwen3VLForConditionalGeneration": "qwen3_vl"}
_MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
_FALLBACK = "; the transformers fallback will be used"


@dataclass
class VLConfig:
    """What the VL model needs: the text decoder's `LatheConfig`, the vision dictionary and the special tokens."""

    architecture: str
    family: str                      # "qwen2_5_vl" | "qwen3_vl"
    text: LatheConfig
    vision: dict[str, Any]
    mrope_section: list[int]         # rotary half-dims given to the (temporal, height, width) position axes
    mrope_interleaved: bool          # Qwen3-VL: axes interleaved (T H W T H W ...); Qwen2.5-VL: one block per axis
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
        if "rope_theta" not in params:
            params["rope_theta"] = text.get("rope_theta", d.get("rope_theta", 1000000.0 if family == "qwen2_5_vl"
                                                                     else 5000000.0))
        section = params.pop("mrope_section", None)
        params.pop("mrope_interleaved", None)
        if (params.get("rope_type") or params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        if not section or len(section) != 3:
            raise ValueError(f"{source}: {arch} needs rope_parameters.mrope_section, three ints (temporal, height, "
                             f"width rotary half-dims), got {section!r}; copy it from the model card's config.json")
        text_cfg = _text_config(text, family, arch, params, source)
        _check_section(section, text_cfg.head_dim, family, source)
        tie = bool(d.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
        text_cfg.tie_word_embeddings = tie
        return cls(architecture=arch, family=family, text=text_cfg, vision=vision,
                   mrope_section=[int(s) for s in section], mrope_interleaved=family == "qwen3_vl", image_token_id=int(d["image_token_id"]),
                   video_token_id=int(d.get("video_token_id", -1)),
                   vision_start_token_id=d.get("vision_start_token_id"), tie_word_embeddings=tie,
                   torch_dtype=d.get("dtype") or d.get("torch_dtype") or text.get("dtype"), hf_config=dict(d))


def _text_config(t: dict[str, Any], family: str, arch: str, rope_params: dict, source: str) -> LatheConfig:
    """The language model as lathe's decoder sees it: Qwen2-style (q/k/v bias) or Qwen3-style (q/k norm)."""
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
    qwen3 = family == "qwen3_vl"
    bias = bool(t.get("attention_bias", False))
    return LatheConfig(
        architecture=arch, vocab_size=int(t["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(t["intermediate_size"]), num_hidden_layers=int(t["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        # Qwen2.5-VL ignores a head_dim key (always hidden / heads); Qwen3-VL reads it (default 128)
        head_dim=int(t.get("head_dim", 128)) if qwen3 else hidden // heads,
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        qkv_bias=bias if qwen3 else True, o_bias=bias if qwen3 else False, qk_norm=qwen3, rope=rope,
        torch_dtype=t.get("dtype") or t.get("torch_dtype"), hf_config=dict(t))


def _check_section(section: list[int], head_dim: int, family: str, source: str) -> None:
    half = head_dim // 2
    if family == "qwen2_5_vl" and sum(section) != half:
        raise ValueError(f"{source}: mrope_section {section} must sum to head_dim / 2 = {half}; fix "
                         "rope_parameters.mrope_section")
    if family == "qwen3_vl" and 3 * max(section[1], section[2]) > half:
        raise ValueError(f"{source}: interleaved mrope_section {section} needs 3 * max(height, width) <= "
                         f"head_dim / 2 = {half}; fix rope_parameters.mrope_section")
