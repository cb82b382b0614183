"""A tiny random transformers Nemotron-H (test helper, not a test): six layers (Mamba2, MoE, attention, MLP, Mamba2,
MoE), 8 routed experts in 4 groups (top-2 groups, top-3 experts), a shared expert; optionally latent projections
around the routed experts. Norms, biases, the Mamba2 parameters and the selection bias are randomised off their
initial values."""

from __future__ import annotations

import torch

VOCAB = 101
BLOCKS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
PATTERN = "ME*-ME"          # the same as the older configs' `hybrid_override_pattern`, which every transformers 5 reads


def nemotron_config(**overrides):
    from transformers import NemotronHConfig
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern=PATTERN, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                  n_groups=2, ssm_state_size=8, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, max_position_embeddings=64, initializer_range=0.1,
                  tie_word_embeddings=False, eos_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=None)
    kwargs.update(overrides)
    return NemotronHConfig(**kwargs)


def nemotron_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random `NemotronHForCausalLM` (eval mode, SDPA attention, transformers' eager experts) in `dtype`."""
    from transformers import NemotronHForCausalLM
    torch.manual_seed(seed)
    cfg = nemotron_config(**overrides)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", ".D", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.normal_(0.0, 0.2)
    return model.to(dtype).eval()
