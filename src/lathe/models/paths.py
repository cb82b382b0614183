"""Where a model comes from, checked without loading it (and without importing torch or transformers).

A model path is `builtin:<shape>` (a tiny model built in code), a local Hugging Face checkpoint directory, or a hub
id (`org/name`). `resolve` is what every loader calls; `check_model` and `check_tokenizer` are what `lathe train` and
`lathe sft` run before anything loads (`lathe.loop.preflight`), with the config key in every message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The built-in model: a Qwen2-shaped decoder small enough to train on two CPU cores in minutes.
BUILTIN_SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2),
}
_GIVE = "give a local Hugging Face checkpoint directory, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or builtin:tiny"
# Where lathe's own checkpoints keep a loadable Hugging Face directory, below a run's global_step_N.
_CHECKPOINT_SUBDIRS = ("actor/huggingface", "huggingface")


def cache_root() -> Path:
    """Where lathe keeps caches (warm-started models, the engine's measured choices): $LATHE_CACHE_DIR, else
    $XDG_CACHE_HOME/lathe, else ~/.cache/lathe."""
    if os.environ.get("LATHE_CACHE_DIR"):
        return Path(os.environ["LATHE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lathe"


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message says why and what to do."""


def is_builtin(path: str | None) -> bool:
    return bool(path) and str(path).startswith(BUILTIN_PREFIX)


def _named(path: str, key: str | None) -> str:
    return f"{key}={str(path)!r}" if key else f"model path {str(path)!r}"


def unknown_builtin(path: str, key: str | None = None) -> ModelLoadError | None:
    """The error for a `builtin:<shape>` that names no built-in shape, else None."""
    if path[len(BUILTIN_PREFIX):] in BUILTIN_SHAPES:
        return None
    known = ", ".join(BUILTIN_PREFIX + s for s in BUILTIN_SHAPES)
    return ModelLoadError(f"{key + ': ' if key else ''}unknown built-in model {path!r}; known: {known}. Fix: use one "
                          "of them, or a local Hugging Face checkpoint directory.")


def resolve(path: str, key: str | None = None) -> str:
    """The local directory `path` names (`~` expanded), or `path` itself when it is a hub id; a ModelLoadError
    naming `key` otherwise."""
    expanded = os.path.expanduser(str(path))
    if not expanded.strip():
        raise ModelLoadError(f"{key or 'the model path'} is empty. Fix: {_GIVE}.")
    if Path(expanded).is_dir():
        return expanded
    if Path(expanded).exists():
        raise ModelLoadError(f"{_named(path, key)} is a file; it must be a directory holding config.json, the "
                             "weights (*.safetensors) and the tokenizer files. Fix: give that directory.")
    if not HUB_ID.match(str(path)):
        raise ModelLoadError(f"{_named(path, key)}: no such directory. Fix: {_GIVE}.")
    return str(path)


def check_model(path: str, key: str) -> None:
    """A model path that cannot load fails here, naming `key`: an unknown built-in, a missing directory, a
    directory without config.json, a hub id that is not in the local cache while the hub is offline."""
    if is_builtin(path):
        if (err := unknown_builtin(path, key)) is not None:
            raise err
        return
    local = resolve(path, key)
    if Path(local).is_dir():
        if not (Path(local) / "config.json").is_file():
            raise ModelLoadError(f"{_named(path, key)} has no config.json, so it is not a Hugging Face checkpoint "
                                 f"directory. Fix: {_checkpoint_hint(Path(local))}")
        return
    _check_hub_cache(local, key, "config.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer(path: str, key: str) -> None:
    """A tokenizer path that cannot load fails here: a missing directory, or a hub id not cached while offline
    (any `builtin:` name means the built-in tokenizer)."""
    if is_builtin(path):
        return
    local = resolve(path, key)
    if not Path(local).is_dir():
        _check_hub_cache(local, key, "tokenizer_config.json")
    elif not any((Path(local) / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer of the config's model_type from it, without a word
        raise ModelLoadError(f"{key}={path}: the directory has no tokenizer files ({', '.join(TOKENIZER_FILES)}). "
                                "Fix: save the tokenizer there (tokenizer.save_pretrained(dir)), or name a directory "
                                "that holds one.")


def _checkpoint_hint(directory: Path) -> str:
    for sub in _CHECKPOINT_SUBDIRS:
        if (directory / sub / "config.json").is_file():
            return f"use {directory / sub} (a lathe checkpoint keeps its Hugging Face directory there)."
    return ("point it at the directory that holds config.json and the weights (in a lathe checkpoint: "
            ".../global_step_N/actor/huggingface), or export one with `lathe export RUN_DIR OUT_DIR`.")


def _check_hub_cache(repo_id: str, key: str, filename: str) -> None:
    """Offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), a hub id loads only from the local cache: say so now when
    the cache has no copy. Online, the loader downloads it; nothing is checked here."""
    from huggingface_hub import constants, try_to_load_from_cache
    if not constants.HF_HUB_OFFLINE:
        return
    if isinstance(try_to_load_from_cache(repo_id, filename), str):
        return
    raise ModelLoadError(f"{_named(repo_id, key)} is not a local directory, so it is read as a hub id, and the hub "
                         f"is offline (HF_HUB_OFFLINE=1) with no copy in the cache ({constants.HF_HUB_CACHE}). Fix: "
                         f"download it where there is network (`hf download {repo_id}`) and copy the cache here, or "
                         f"set {key} to a local checkpoint directory.")
