"""Value models for the PPO critic: a decoder with a one-output token-classification head (``score``).

Like verl, a critic is ``AutoModelForTokenClassification`` with ``num_labels=1``: the backbone of a causal
LM checkpoint plus a linear ``score`` head that reads one scalar value off every position's hidden state.
Dropout in the head is switched off (``classifier_dropout=0``), as verl does, so a training-mode forward is
deterministic and gradient accumulation over micro-batches is exact.

A head that the checkpoint does not hold (a causal LM loaded as a critic for the first time) starts at
zero, so the first values are exactly 0 whatever the seed; a saved critic keeps its trained head.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from lathe.dtypes import to_dtype
from lathe.models.hf import BUILTIN_PREFIX, ModelLoadError, _explain, build_builtin_model, is_builtin, loading_problem
from lathe.models.paths import resolve
from lathe.models.rope import cast_keeping_rope

__all__ = ["VALUE_HEAD", "load_value_model", "build_builtin_value_model"]

log = logging.getLogger("lathe")

VALUE_HEAD = "score"   # the head's module name in transformers' *ForTokenClassification models


def load_value_model(path: str, *, vocab_size: int | None = None, seed: int = 0, trust_remote_code: bool = False,
                     dtype: torch.dtype | str = torch.float32, override_config: dict | None = None,
                     impl: str = "auto"):
    """A value model from ``path``: a local HF directory, a hub id, or ``builtin:<shape>``.

    A checkpoint whose architecture lathe's decoder runs loads as lathe's value model directly (one copy of the
    weights; `load_lathe_value_model`); another, or one with `impl` hf or `override_config`, through
    ``AutoModelForTokenClassification(num_labels=1)``; a missing ``score`` head is zero-initialised. A Qwen3.5 vision-language checkpoint's language model loads as lathe's value
    model directly (`lathe.models.vl.load_language_model`), saved as the whole model's token-classification form
    (not with `impl` hf, where transformers' model is asked for).
    ``builtin:<shape>`` builds the built-in policy's architecture with the same seeded backbone weights (see
    ``build_builtin_value_model``).
    """
    dtype = to_dtype(dtype, "critic.model.fsdp_config.model_dtype")
    if is_builtin(path):
        return build_builtin_value_model(path[len(BUILTIN_PREFIX):], vocab_size=vocab_size, seed=seed, dtype=dtype)
    from transformers import AutoConfig, AutoModelForTokenClassification
    local = resolve(path, "critic.model.path")
    local_only = Path(local).is_dir()
    from lathe.models import load_lathe_value_model
    from lathe.models.config import UnsupportedArchitecture
    from lathe.models.hf import direct_checkpoint_dir, is_vl_path, vl_checkpoint_dir
    from lathe.models.vl import language_model_runs_alone, load_language_model
    if impl != "hf" and not override_config and is_vl_path(path) and language_model_runs_alone(
            checkpoint := vl_checkpoint_dir(path)):
        return load_language_model(checkpoint, dtype, value=True)      # Qwen3.5's language model, a critic's backbone
    direct = direct_checkpoint_dir(path) if impl != "hf" and not override_config else None
    if direct is not None:          # one copy of the weights, no transformers model converted after
        try:
            return load_lathe_value_model(direct, dtype)
        except UnsupportedArchitecture as e:      # tensors lathe's decoder does not know: transformers decides
            log.info("critic: %s", e)
    try:
        config = AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code, local_files_only=local_only)
        for key, value in {"num_labels": 1, "classifier_dropout": 0.0, **(override_config or {})}.items():
            setattr(config, key, value)
        model, info = AutoModelForTokenClassification.from_pretrained(
            local, config=config, trust_remote_code=trust_remote_code, dtype=dtype, local_files_only=local_only,
            output_loading_info=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(path, "value model (critic.model.path)", e)) from e
    is_head = lambda k: k.startswith(VALUE_HEAD + ".") or f".{VALUE_HEAD}." in k   # noqa: E731
    backbone = {"missing_keys": [k for k in info.get("missing_keys", ()) if not is_head(k)],
                "mismatched_keys": info.get("mismatched_keys", ())}    # (a causal LM's lm_head is left over)
    problem = loading_problem(backbone, type(model).__name__)
    if problem:
        raise ModelLoadError(f"critic.model.path={path}: {problem}")
    if any(is_head(k) for k in info.get("missing_keys", ())):
        _zero_value_head(model)
    return model


def build_builtin_value_model(shape: str, *, vocab_size: int | None, seed: int = 0, dtype=torch.float32):
    """The built-in policy of ``shape`` (same config, same seeded backbone) with a zero value head.

    Starting the critic's backbone from the policy's initial weights mirrors verl, where the critic is
    usually loaded from the actor's checkpoint.
    """
    from transformers import Qwen2ForTokenClassification
    policy = build_builtin_model(shape, vocab_size=vocab_size, seed=seed, dtype=torch.float32)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = ["Qwen2ForTokenClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForTokenClassification(config)
    backbone = {k: v for k, v in policy.state_dict().items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or any(not k.startswith(VALUE_HEAD + ".") for k in missing):
        raise RuntimeError(f"builtin:{shape} value model: backbone mismatch, missing {missing}, "
                           f"unexpected {unexpected}")
    _zero_value_head(model)
    return cast_keeping_rope(model, dtype)


def _zero_value_head(model) -> None:
    """Initial values are exactly 0: the first GAE step sees V = 0 instead of random noise."""
    head = getattr(model, VALUE_HEAD, None)
    if not isinstance(head, torch.nn.Linear):
        raise ModelLoadError(f"value model {type(model).__name__} has no linear '{VALUE_HEAD}' head; critic.model.path "
                             "must be a decoder that transformers can load with AutoModelForTokenClassification")
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
