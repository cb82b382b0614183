"""`actor_rollout_ref.model.mtp.enable_rollout` (speculative decoding, config/rules_mtp.py): the draft count read from
the backend's keys, and what is refused naming the value."""

from __future__ import annotations

import re

import pytest

from lathe.config import ConfigError, load_config
from lathe.config.rules_mtp import speculative_tokens

M, R = "actor_rollout_ref.model.mtp", "actor_rollout_ref.rollout"
ON = (f"{M}.enable=true", f"{M}.enable_rollout=true")


def load(*overrides: str):
    return load_config("base", list(overrides))


def test_drafts_come_from_the_named_backends_keys():
    assert speculative_tokens(load(*ON).actor_rollout_ref) == 3                     # SGLang's default num_steps
    assert speculative_tokens(load(*ON, f"{M}.speculative_num_steps=2",
                                   f"{M}.speculative_num_draft_tokens=3").actor_rollout_ref) == 2
    assert speculative_tokens(load(*ON, f"{R}.name=vllm", f"{M}.num_speculative_tokens=4").actor_rollout_ref) == 4
    assert speculative_tokens(load(f"{M}.enable=true").actor_rollout_ref) == 0


def test_enable_rollout_without_enable_warns_and_does_nothing():
    with pytest.warns(UserWarning, match="enable_rollout=true has no effect"):
        cfg = load(f"{M}.enable_rollout=true")
    assert speculative_tokens(cfg.actor_rollout_ref) == 0


@pytest.mark.parametrize(("overrides", "message"), [
    ((f"{M}.speculative_eagle_topk=4",), "speculative_eagle_topk=4: tree drafts"),
    ((f"{M}.speculative_num_draft_tokens=8",), "speculative_num_draft_tokens=8 with speculative_num_steps=3"),
    ((f"{M}.speculative_algorithm=EAGLE3",), "speculative_algorithm='EAGLE3'"),
    ((f"{R}.name=vllm", f"{M}.method=eagle"), "method='eagle' (rollout.name=vllm)"),
    ((f"{R}.name=hf",), "name=hf (transformers generate)"),
    ((f"{R}.quantization=fp8",), "quantization=fp8"),
    ((f"{R}.kv_cache_dtype=fp8",), "kv_cache_dtype=fp8 (an FP8 KV cache)"),
    (("actor_rollout_ref.model.lora_rank=8",), "lora_rank=8"),
])
def test_unsupported_variants_are_refused_naming_the_value(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(*ON, *overrides)


def test_the_other_backends_keys_are_not_read():
    """SGLang's tree settings do not matter when vLLM's keys are the ones read, and vice versa."""
    load(*ON, f"{R}.name=vllm", f"{M}.speculative_eagle_topk=4")
    load(*ON, f"{R}.name=sglang", f"{M}.method=eagle")
