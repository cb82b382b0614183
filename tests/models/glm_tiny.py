"""A tiny random transformers GLM-4.5 (`Glm4MoeForCausalLM`; test helper, not a test): 3 layers (layer 0 dense, then
MoE), 8 experts in 4 groups (top-2 groups, top-3 experts), one shared expert, q/k/v biases, q/k norms, RoPE over half
of each head (GLM-4.5's partial_rotary_factor); norms, biases and the selection bias randomised."""

from __future__ import annotations

import torch

VOCAB = 101


def glm_config(**overrides):
    from transformers import Glm4MoeConfig
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                  use_qk_norm=True, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                  num_nextn_predict_layers=1, eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return Glm4MoeConfig(**kwargs)


def glm_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random `Glm4MoeForCausalLM` (eval mode, SDPA attention) in `dtype`."""
    from transformers import Glm4MoeForCausalLM

    from .deepseek_tiny import randomised
    return randomised(Glm4MoeForCausalLM, glm_config(**overrides), seed, dtype)
