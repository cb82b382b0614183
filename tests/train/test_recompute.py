"""`enable_recompute`: a model group's gradient-checkpointing keys switched on in the model the worker trains (actor,
critic and `lathe sft` call it), and a count of recomputed layers refused for a transformers model."""

from __future__ import annotations

import pytest
import torch

from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM
from lathe.train.recompute import enable_recompute


def test_worker_switch_sets_the_stack_and_refuses_a_transformers_model():
    model = LatheCausalLM(LatheConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1}))
    enable_recompute(model, True, 2, "model", lathe=True, impl_key="model.impl")
    assert model.model.gradient_checkpointing and model.model.gradient_checkpointing_layers == 2
    fresh = LatheCausalLM(model.config)
    enable_recompute(fresh, False, None, "model", lathe=True, impl_key="model.impl")
    assert not fresh.model.gradient_checkpointing
    with pytest.raises(ValueError, match=r"model\.gradient_checkpointing_layers=2: only lathe's decoder .*"
                                         r"model\.impl=hf"):
        enable_recompute(torch.nn.Linear(2, 2), True, 2, "model", lathe=False, impl_key="model.impl")
    enable_recompute(torch.nn.Linear(2, 2), True, None, "model", lathe=False, impl_key="model.impl")   # as today
