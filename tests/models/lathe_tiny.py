"""Tiny random transformers checkpoints of each family lathe's decoder implements (test helper, not a test)."""

from __future__ import annotations

import torch

VOCAB = 101
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
FAMILIES = ("llama", "qwen2", "qwen3")
# Qwen3-MoE: 4 experts, top-2, layer 0 dense (`mlp_only_layers`), layer 1 sparse; kept out of FAMILIES (its own tests)
MOE = "qwen3_moe"
# Llama-like families with their own tests (tests/models/test_llama_like.py): Mistral without and with its sliding
# window (5 tokens: shorter than the test sequences), Seed-OSS (q/k/v bias without o bias; its dropout set to 0)
LLAMA_LIKE = ("mistral", "mistral_window", "seed_oss")


def hf_config(family: str, *, tie: bool = False, norm_topk_prob: bool = True, **overrides):
    """A tiny config: Llama with llama3 rope scaling, Qwen2 (q/k/v bias), Qwen3 (q/k norm, head_dim != H/heads),
    Qwen3-MoE (`MOE`; `norm_topk_prob` for it only); the hybrids (`hybrid_config`, which alone takes `overrides`)."""
    if overrides and family not in HYBRIDS:
        raise TypeError(f"hf_config: {sorted(overrides)} are taken for the hybrid families only, not {family}")
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    if family == "llama":
        return LlamaConfig(**_COMMON, tie_word_embeddings=tie, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=tie, rope_theta=1000000.0)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=tie)
    if family in HYBRIDS:
        return hybrid_config(family, tie=tie, **overrides)
    if family in ("mistral", "mistral_window"):
        from transformers import MistralConfig
        return MistralConfig(**_COMMON, head_dim=16, tie_word_embeddings=tie, rope_theta=1000000.0,
                             sliding_window=5 if family == "mistral_window" else None)
    if family == "seed_oss":
        from transformers import SeedOssConfig
        return SeedOssConfig(**_COMMON, head_dim=16, tie_word_embeddings=tie, attention_dropout=0.0,
                             residual_dropout=0.0)
    if family == MOE:
        return Qwen3MoeConfig(**_COMMON, head_dim=16, tie_word_embeddings=tie, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=norm_topk_prob)
    raise KeyError(family)


def hf_model(family: str, *, tie: bool = False, seed: int = 0, **config):
    """A random transformers causal LM (fp32, eval mode); biases, norms (and a hybrid's A_log, dt_bias) randomised so
    bugs show."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie=tie, **config), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "A_log")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf(tmp_path, family: str, *, tie: bool = False, seed: int = 0, config: dict | None = None, **save_kwargs):
    """(directory, model): a random transformers model saved with `save_pretrained`."""
    model = hf_model(family, tie=tie, seed=seed, **(config or {}))
    path = tmp_path / f"{family}-{'tied' if tie else 'untied'}"
    model.save_pretrained(path, **save_kwargs)
    return path, model


def ragged_batch(seed: int = 0, batch_size: int = 4, max_len: int = 20):
    """(input_ids, attention_mask, position_ids): rows of mixed lengths, prompts left-padded and the last
    rows right-padded too, as lathe's trainer builds them (left-padded prompt + right-padded response)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, max_len), generator=gen)
    mask = torch.ones(batch_size, max_len, dtype=torch.long)
    for b in range(batch_size):
        left = int(torch.randint(0, max_len // 2, (1,), generator=gen))
        right = int(torch.randint(0, max_len // 4, (1,), generator=gen)) if b % 2 else 0
        mask[b, :left] = 0
        if right:
            mask[b, max_len - right:] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


# Hybrid linear attention (`lathe.models.qwen3_5`): Qwen3.5, Qwen3.5-MoE, Qwen3-Next; layer 0 gated DeltaNet, layer 1
# gated full attention with partial RoPE; kept out of FAMILIES (their own tests)
HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_HYBRID = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=64, initializer_range=0.1,
               layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def hybrid_config(family: str, *, tie: bool = False, **overrides):
    """A tiny Qwen3.5 (`qwen3_5_text`), Qwen3.5-MoE (`qwen3_5_moe_text`) or Qwen3-Next (`qwen3_next`; layer 0 dense
    by `mlp_only_layers`) text config."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
    kw = dict(_HYBRID, tie_word_embeddings=tie, **overrides)
    if family == "qwen3_5_text":
        return Qwen3_5TextConfig(**kw, intermediate_size=64)
    if family == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(**kw, **_HYBRID_MOE)
    if family == "qwen3_next":
        return Qwen3NextConfig(**kw, **_HYBRID_MOE, intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=True)
    raise KeyError(family)
