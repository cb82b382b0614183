"""Reading a Nemotron-H `config.json` (`model_type: nemotron_h`, `NemotronHForCausalLM`: NVIDIA-Nemotron-3-Nano,
Nemotron-H) into the fields of `LatheConfig` (torch-free, like `lathe.models.config`; `lathe.models.nemotron_h`
computes the layers).

A Nemotron-H decoder layer is a norm and one token mixer or MLP, by its block type (`layers_block_type`, or the
older `hybrid_override_pattern` string: M, *, -, E):
- `linear_attention` (M, "mamba" in older configs): Mamba2 (`Mamba2Config`);
- `full_attention` (*, "attention"): grouped-query attention with no RoPE, no q/k norm and no biases;
- `mlp` (-): up_proj, relu^2, down_proj (`intermediate_size`);
- `moe` (E): DeepSeek-V3's router (sigmoid scores, selection bias, groups, `routed_scaling_factor`) over non-gated
  relu^2 experts of `moe_intermediate_size`, optionally between latent projections (`moe_latent_size`), plus one
  shared relu^2 expert of `moe_shared_expert_intermediate_size`.
Keys a config.json leaves out get transformers' `NemotronHConfig` defaults (`DEFAULTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURE = "NemotronHForCausalLM"
FALLBACK = "; the transformers fallback will be used"
BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
# transformers' `NemotronHConfig` defaults, for keys a config.json leaves out
DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 4096, "intermediate_size": 21504, "mlp_hidden_act": "relu2",
            "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
            "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4, "use_conv_bias": True, "use_bias": False,
            "n_routed_experts": 8, "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
            "moe_latent_size": None, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "layer_norm_epsilon": 1e-5, "num_nextn_predict_layers": 0,
            "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]}
# the `mamba_*` spellings of the Hub's configs (transformers reads them into the plain keys)
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_limit": "mamba_dt_limit",
           "use_conv_bias": "mamba_conv_bias"}


@dataclass
class Mamba2Config:
    """A Nemotron-H `config.json`'s Mamba keys. Its `chunk_size` is not read: the scan's chunk changes only its
    rounding (`lathe.models.ssd.chunk_scan` picks its own)."""

    hidden_size: int
    num_heads: int                          # mamba_num_heads
    head_dim: int                           # mamba_head_dim
    n_groups: int                           # n_groups / mamba_n_groups
    state_size: int                         # ssm_state_size
    conv_kernel: int = 4                    # conv_kernel / mamba_d_conv
    conv_bias: bool = True                  # use_conv_bias / mamba_conv_bias
    proj_bias: bool = False                 # use_bias
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    eps: float = 1e-5                       # layer_norm_epsilon

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Mamba2Config":
        heads, groups = int(_get(d, "mamba_num_heads")), int(_get(d, "n_groups"))
        if heads % groups:
            raise ValueError(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}. Fix config.json")
        limit = _get(d, "time_step_limit", (0.0, float("inf")))
        return cls(hidden_size=int(_get(d, "hidden_size")), num_heads=heads, head_dim=int(_get(d, "mamba_head_dim")),
                   n_groups=groups, state_size=int(_get(d, "ssm_state_size")),
                   conv_kernel=int(_get(d, "conv_kernel")), conv_bias=bool(_get(d, "use_conv_bias")),
                   proj_bias=bool(_get(d, "use_bias")), time_step_limit=(_number(limit[0]), _number(limit[1])),
                   eps=float(_get(d, "layer_norm_epsilon")))


@dataclass
class NemotronConfig:
    """What a Nemotron-H decoder adds to a `LatheConfig` (module doc)."""

    block_types: tuple[str, ...]            # per decoder layer, one of `BLOCK_TYPES`
    mamba: Mamba2Config
    shared_expert_intermediate_size: int    # the MoE layers' shared expert
    moe_latent_size: int | None = None      # the routed experts' width in and out (None: hidden_size, no projections)

    def layers(self, kind: str) -> list[int]:
        """The indices of the layers of block type `kind`."""
        return [i for i, t in enumerate(self.block_types) if t == kind]


def _number(v: Any) -> float:
    """A float of config.json: transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) and "__float__" in v else v)


def _get(d: dict[str, Any], key: str, default: Any = None) -> Any:
    alias = ALIASES.get(key)
    if alias is not None and alias in d:
        return d[alias]
    if key in d and d[key] is not None:
        return d[key]
    return DEFAULTS.get(key, default)


def block_types(d: dict[str, Any], source: str) -> tuple[str, ...]:
    """Each layer's block type: `layers_block_type` (or its alias `layer_types`; older names remapped), else
    `hybrid_override_pattern`, else transformers' default."""
    types = d.get("layers_block_type") or d.get("layer_types")
    pattern = d.get("hybrid_override_pattern")
    if not types and pattern:
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(f"{source}: hybrid_override_pattern={pattern!r} has {unknown}; each character is one "
                             f"of {', '.join(PATTERN)}. Fix config.json")
        return tuple(PATTERN[c] for c in pattern)
    types = tuple(LEGACY.get(t, t) for t in (types or DEFAULTS["layers_block_type"]))
    bad = sorted({t for t in types if t not in BLOCK_TYPES})
    if bad:
        raise ValueError(f"{source}: layers_block_type has {bad}; each entry is one of {', '.join(BLOCK_TYPES)}. Fix "
                         "config.json")
    return types


def refuse_nemotron_features(d: dict[str, Any], source: str) -> None:
    """Refuse what lathe's Nemotron-H layers do not compute (the transformers fallback then runs the model)."""
    from lathe.models import quantized
    from lathe.models.config import UnsupportedArchitecture
    quantized.scheme(d, source)
    for key, value in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if _get(d, key) != value:
            raise UnsupportedArchitecture(f"{source}: {ARCHITECTURE} with {key}={_get(d, key)!r} (lathe implements "
                                          f"{value}){FALLBACK}")
    if d.get("sliding_window"):
        raise UnsupportedArchitecture(f"{source}: {ARCHITECTURE} with sliding_window={d['sliding_window']} (lathe's "
                                      f"Nemotron-H attends over the whole sequence){FALLBACK}")


def nemotron_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The `LatheConfig` keyword arguments of a Nemotron-H config (all but architecture and hf_config)."""
    from lathe.models.config import MoeConfig
    refuse_nemotron_features(d, source)
    types = block_types(d, source)
    layers, heads = len(types), int(_get(d, "num_attention_heads"))
    moe = None
    if "moe" in types:
        experts, top_k = int(d.get("n_routed_experts") or d.get("num_local_experts") or
                             DEFAULTS["n_routed_experts"]), int(_get(d, "num_experts_per_tok"))
        groups, top_groups = int(_get(d, "n_group")), int(_get(d, "topk_group"))
        if experts % groups or top_groups > groups or not 1 <= top_k <= experts or \
                groups > 1 and experts // groups < 2:
            raise ValueError(f"{source}: n_routed_experts={experts} must split into n_group={groups} groups (of 2 "
                             f"or more experts when there are several), topk_group={top_groups} must be at most "
                             f"n_group and num_experts_per_tok={top_k} 1 .. n_routed_experts. Fix config.json")
        moe = MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=int(_get(d, "moe_intermediate_size")),
                        norm_topk_prob=bool(_get(d, "norm_topk_prob")),
                        mlp_only_layers=tuple(i for i, t in enumerate(types) if t != "moe"),
                        scoring="sigmoid", n_group=groups, topk_group=top_groups,
                        routed_scaling_factor=float(_get(d, "routed_scaling_factor")), n_shared_experts=1)
    latent = _get(d, "moe_latent_size")
    nemotron = NemotronConfig(block_types=types, mamba=Mamba2Config.from_hf_dict(d),
                              shared_expert_intermediate_size=int(_get(d, "moe_shared_expert_intermediate_size")),
                              moe_latent_size=int(latent) if latent else None)
    return dict(vocab_size=int(_get(d, "vocab_size")), hidden_size=int(_get(d, "hidden_size")),
                intermediate_size=int(_get(d, "intermediate_size")), num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=int(_get(d, "num_key_value_heads") or heads),
                head_dim=int(_get(d, "head_dim") or int(_get(d, "hidden_size")) // heads),
                max_position_embeddings=int(_get(d, "max_position_embeddings")),
                rms_norm_eps=float(_get(d, "layer_norm_epsilon")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), mlp_bias=bool(_get(d, "mlp_bias")),
                moe=moe, nemotron=nemotron, torch_dtype=d.get("dtype") or d.get("torch_dtype"))
