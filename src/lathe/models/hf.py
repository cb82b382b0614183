"""Loading causal LMs and tokenizers: a local Hugging Face directory, a hub id, or the built-in tiny model.

A local directory never touches the network. A hub id is fetched only when the user names one, and an
offline failure says so plainly. `trust_remote_code` stays off unless the user sets it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

BUILTIN_PREFIX = "builtin:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The built-in model: a Qwen2-shaped decoder small enough to train on two CPU cores in minutes.
BUILTIN_SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2),
}


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message says why and what to do."""


def is_builtin(path: str | None) -> bool:
    return bool(path) and str(path).startswith(BUILTIN_PREFIX)


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """The tokenizer of `path` (a local directory, a hub id, or `builtin:<name>`)."""
    if is_builtin(path):
        from lathe.data.builtin import builtin_tokenizer
        return builtin_tokenizer()
    from transformers import AutoTokenizer
    local = _resolve(path)
    try:
        tok = AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code,
                                            local_files_only=Path(local).is_dir())
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(path, "tokenizer", e)) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                   vocab_size: int | None = None, seed: int = 0, override_config: dict | None = None):
    """A causal LM from `path`. `builtin:<shape>` builds a random model (seeded) of a named shape."""
    if is_builtin(path):
        return build_builtin_model(path[len(BUILTIN_PREFIX):], vocab_size=vocab_size, seed=seed, dtype=dtype)
    from transformers import AutoModelForCausalLM
    local = _resolve(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            local, trust_remote_code=trust_remote_code, dtype=dtype, local_files_only=Path(local).is_dir(),
            **(override_config or {}))
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(path, "model", e)) from e
    return model


def build_builtin_model(shape: str, *, vocab_size: int | None, seed: int = 0, dtype=torch.float32):
    """A randomly initialised Qwen2-architecture model of a built-in shape (see `BUILTIN_SHAPES`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    if shape not in BUILTIN_SHAPES:
        raise ModelLoadError(f"unknown built-in model 'builtin:{shape}'; known: "
                             f"{', '.join(BUILTIN_PREFIX + s for s in BUILTIN_SHAPES)}")
    tok = builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab_size or len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, attn_implementation="sdpa", **BUILTIN_SHAPES[shape])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype)


def _resolve(path: str) -> str:
    expanded = os.path.expanduser(str(path))
    if Path(expanded).is_dir():
        return expanded
    if Path(expanded).exists():
        raise ModelLoadError(f"actor_rollout_ref.model.path={path!r} is a file; it must be a directory holding "
                             "config.json, the weights (*.safetensors) and the tokenizer files")
    if not _HUB_ID.match(str(path)):
        raise ModelLoadError(f"actor_rollout_ref.model.path={path!r}: no such directory. Give a local Hugging Face "
                             "checkpoint directory, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or builtin:tiny")
    return str(path)


def _explain(path: str, what: str, err: Exception) -> str:
    msg = f"could not load the {what} from {path!r}: {err}"
    if not Path(os.path.expanduser(str(path))).is_dir():
        msg += ("\nThis looks like a hub id, which needs network access to huggingface.co. If this machine is "
                "offline, download the checkpoint elsewhere and set actor_rollout_ref.model.path to its local "
                "directory (or set HF_HUB_OFFLINE=1 to use a copy already in the local cache).")
    if "trust_remote_code" in str(err):
        msg += "\nThe checkpoint ships its own code: set actor_rollout_ref.model.trust_remote_code=true if you trust it."
    return msg
