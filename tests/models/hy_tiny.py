"""A tiny random transformers HY-V3 (`HYV3ForCausalLM`, Tencent's Hy3; test helper, not a test): 3 layers (layer 0
dense, then MoE), 8 experts (top-3, sigmoid scores, a selection bias, renormalised and scaled by
router_scaling_factor), one shared expert, q/k norms; norms, biases and the selection bias randomised."""

from __future__ import annotations

import torch

VOCAB = 101


def hy_config(**overrides):
    from transformers import HYV3Config
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=3, num_shared_experts=1, router_scaling_factor=2.826,
                  max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return HYV3Config(**kwargs)


def hy_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random `HYV3ForCausalLM` (eval mode, SDPA attention) in `dtype`."""
    from transformers import HYV3ForCausalLM

    from .deepseek_tiny import randomised
    return randomised(HYV3ForCausalLM, hy_config(**overrides), seed, dtype)
