"""A tiny random transformers DeepSeek-V3 (test helper, not a test): 3 layers (layer 0 dense, then MoE), 8 experts in
4 groups (top-2 groups, top-3 experts), one shared expert, q through its low-rank path, interleaved YaRN RoPE with
mscale (so the softmax scale moves), v's head width below q/k's; norms and the selection bias randomised."""

from __future__ import annotations

import torch

VOCAB = 101


def deepseek_config(**overrides):
    from transformers import DeepseekV3Config
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=64,
                  initializer_range=0.1, tie_word_embeddings=False, rope_interleave=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                   "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "original_max_position_embeddings": 16},
                  eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def deepseek_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random `DeepseekV3ForCausalLM` (eval mode, SDPA attention) in `dtype`."""
    from transformers import DeepseekV3ForCausalLM
    return randomised(DeepseekV3ForCausalLM, deepseek_config(**overrides), seed, dtype)


def randomised(model_class, cfg, seed: int, dtype: torch.dtype):
    """`model_class(cfg)` (a DeepSeek-V3-style MoE: DeepSeek-V3, GLM-4.5, HY-V3) seeded, on SDPA attention and
    transformers' eager experts (its grouped-mm path refuses float64), its norms and biases shifted off their initial
    values and the sparse layers' selection biases drawn at random; eval mode, in `dtype`."""
    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, bias in model.named_buffers():        # (HY-V3 keeps it on the block, the others on the gate)
            if name.endswith("e_score_correction_bias"):
                bias.normal_(0.0, 0.2)
    return model.to(dtype).eval()
