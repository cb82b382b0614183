"""Models: lathe's own decoder (Llama, Qwen2/2.5, MiMo, Qwen3, Qwen3-MoE, GPT-OSS, the DeepSeek-V3 family; the hybrid
Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and the transformers fallback loader.

`load_lathe_model(path)` builds lathe's decoder from a local Hugging Face checkpoint directory, or raises
`UnsupportedArchitecture` (a ValueError whose message names the architecture and says that the
transformers fallback will be used); callers catch it and load with `lathe.models.hf.load_causal_lm`.

Importing this package does not import torch (the loaders import it when called), so that `lathe.models.paths` can
check a model path before anything heavy loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lathe.models.config import SUPPORTED_ARCHITECTURES, LatheConfig, UnsupportedArchitecture

if TYPE_CHECKING:
    import torch

__all__ = ["SUPPORTED_ARCHITECTURES", "LatheConfig", "UnsupportedArchitecture", "load_lathe_model",
           "load_lathe_value_model", "load_lathe_vl_model", "supports"]


def supports(path: str | Path) -> tuple[bool, str]:
    """(True, architecture) when lathe's decoder runs the checkpoint, else (False, the reason)."""
    try:
        cfg = LatheConfig.from_pretrained(path)
    except UnsupportedArchitecture as e:
        return False, str(e)
    return True, cfg.architecture


def load_lathe_model(path: str | Path, dtype: torch.dtype | None = None, *,
                     device: str | torch.device = "cpu", dist_checkpoint: str | Path | None = None,
                     dist_checkpoint_prefix: str = ""):
    """A `LatheCausalLM` with the weights of the checkpoint directory `path`, in `dtype` (float32 by default) on
    `device`. `dist_checkpoint`: a Megatron distributed checkpoint whose weights replace `path`'s (`path` then gives
    only config.json; `lathe.models.megatron_ckpt`), `dist_checkpoint_prefix` the prefix of its keys."""
    import torch
    dtype = torch.float32 if dtype is None else dtype
    from lathe.models.decoder import LatheCausalLM
    from lathe.models.io import load_into, read_state_dict
    cfg = LatheConfig.from_pretrained(path)
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{path}: {cfg.architecture} is a value (token-classification) checkpoint; "
                                      "load it with load_lathe_value_model")
    with torch.device("meta"):
        model = LatheCausalLM(cfg)
    if dist_checkpoint is not None:
        from lathe.models.megatron_ckpt import read_megatron_state_dict
        state = {k: v.to(device) for k, v in read_megatron_state_dict(dist_checkpoint, cfg, dtype=dtype,
                                                                     prefix=dist_checkpoint_prefix).items()}
        load_into(model, state, f"{dist_checkpoint} (the Megatron checkpoint, with {path}'s config.json)")
    else:
        load_into(model, read_state_dict(path, dtype=dtype, device=device), str(path))
    return model


def load_lathe_value_model(path: str | Path, dtype: torch.dtype | None = None, *,
                           device: str | torch.device = "cpu"):
    """A `LatheValueModel` (critic) from a causal-LM or token-classification checkpoint.

    From a causal LM (how verl initialises its critic from the actor) `lm_head` is dropped and the
    `score` head starts at zero, so the first values are exactly 0 (as `lathe.models.value` does for
    transformers critics); from a token-classification checkpoint `score` is loaded. `dtype`: float32 by default.
    """
    import torch
    dtype = torch.float32 if dtype is None else dtype
    from lathe.models.io import read_state_dict
    cfg = LatheConfig.from_pretrained(path)
    state = {k: v for k, v in read_state_dict(path, dtype=dtype, device=device).items() if k != "lm_head.weight"}
    if cfg.num_mtp_layers:          # a critic predicts values, not tokens: a policy's MTP layers have no use there
        from lathe.models.mtp import MTP_PREFIX
        state = {k: v for k, v in state.items() if not k.startswith(MTP_PREFIX)}
        cfg.num_mtp_layers = 0
    return value_model_of(cfg, state, str(path), dtype=dtype, device=device)


def value_model_of(cfg: LatheConfig, state: dict, source: str, *, dtype, device):
    """A `LatheValueModel` of `cfg` holding `state` (a causal LM's tensors without `lm_head`, or a token-classification
    checkpoint's): its `score` head as saved, or zero (the first values exactly 0) where `state` has none."""
    import torch
    from lathe.models.decoder import LatheValueModel
    from lathe.models.io import load_into
    score_bias = "score.bias" in state or "score.weight" not in state
    cfg.tie_word_embeddings = False   # a critic has no lm_head to tie
    with torch.device("meta"):
        model = LatheValueModel(cfg, score_bias=score_bias)
    if load_into(model, state, source, optional=("score.",)):
        model.score = torch.nn.Linear(cfg.hidden_size, 1, bias=score_bias, device=device, dtype=dtype)
        torch.nn.init.zeros_(model.score.weight)
        if score_bias:
            torch.nn.init.zeros_(model.score.bias)
    return model


def load_lathe_vl_model(path: str | Path, dtype: torch.dtype | None = None, *, device: str | torch.device = "cpu",
                        vision_attn_implementation: str = "sdpa"):
    """A `LatheVLForConditionalGeneration` (Qwen2.5-VL / Qwen3-VL / Qwen3.5) from a checkpoint directory; see
    `lathe.models.vl`. `load_lathe_model` keeps refusing VL checkpoints (its callers expect a text model)."""
    import torch
    dtype = torch.float32 if dtype is None else dtype
    from lathe.models.vl import load_lathe_vl_model as load
    return load(path, dtype, device=device, vision_attn_implementation=vision_attn_implementation)
