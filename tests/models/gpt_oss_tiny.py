"""A tiny random transformers GPT-OSS (test helper, not a test): 2 layers (sliding window 4, then full attention),
4 experts top-2, YaRN RoPE, a SwiGLU limit small enough that the clamps act; biases, sinks and norms randomised."""

from __future__ import annotations

import torch

VOCAB = 101


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.1,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
                  layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
                  eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def gpt_oss_model(seed: int = 0, **overrides):
    """A random `GptOssForCausalLM` (fp32, eval mode, eager attention: transformers' GPT-OSS has no SDPA path)."""
    from transformers import GptOssForCausalLM
    torch.manual_seed(seed)
    cfg = gpt_oss_config(**overrides)
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()
