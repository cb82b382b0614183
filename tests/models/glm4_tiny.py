"""A tiny random transformers GLM-4 (`Glm4ForCausalLM`; test helper, not a test): 2 layers, 4 query heads over 2
key/value heads of 16 features, q/k/v biases, RoPE over half of each head in GLM-4's interleaved pairs, norms on the
attention's and the MLP's outputs, a fused gate_up_proj; norms and biases randomised off their initial values."""

from __future__ import annotations

import torch

VOCAB = 101


def glm4_config(**overrides):
    from transformers import Glm4Config
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attention_bias=True, max_position_embeddings=64,
                  initializer_range=0.1, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                  eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return Glm4Config(**kwargs)


def glm4_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random `Glm4ForCausalLM` (eval mode, SDPA attention) in `dtype`."""
    from transformers import Glm4ForCausalLM

    from .deepseek_tiny import randomised
    return randomised(Glm4ForCausalLM, glm4_config(**overrides), seed, dtype)
