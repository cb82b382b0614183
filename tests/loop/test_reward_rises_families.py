"""GRPO on the built-in task lifts the reward for a tiny Qwen3-MoE and a tiny Qwen3.5 (gated-DeltaNet hybrid), as it
does for the built-in Qwen2-shaped model (issue 44): the families' trainer and engine paths learn, not just run."""

from __future__ import annotations

import pytest
import torch

from lathe.cli import main
from lathe.models.hf import load_tokenizer

from helpers import stop_once_risen

from .test_reward_rises import scores_of


def tiny_family_checkpoint(family: str, where):
    """A random transformers checkpoint of `family` over the built-in tokenizer's vocabulary at the built-in model's
    width (hidden 128, 4 heads / 2 KV heads; 3 layers, the Qwen3.5 2)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3MoeConfig
    tok = load_tokenizer("builtin:tiny")
    common = dict(vocab_size=len(tok), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=384, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=192, norm_topk_prob=True)
    else:       # two layers (one of each kind) and narrow linear-attention heads: the torch delta rule is slow on CPU
        cfg = Qwen3_5TextConfig(**{**common, "num_hidden_layers": 2}, intermediate_size=384,
                                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(where)
    return where


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text"])
def test_grpo_lifts_the_reward(tmp_path, monkeypatch, family):
    """80 warm-start steps leave the score near 0.55; 30 GRPO steps lift the 10-step mean by 0.07-0.09 (2026-11-30:
    Qwen3-MoE 0.58 -> 0.65, Qwen3.5 0.50 -> 0.60; 20-50 s each on this machine). A 10-step mean of 256 samples a
    step varies by ~0.01, so 0.04 is learning, with room for another machine's summation order. (Within 30 steps:
    the run stops once its last 10 steps show the rise, tests/helpers.py stop_once_risen.)"""
    stop_once_risen(monkeypatch, 0.04)
    path = tiny_family_checkpoint(family, tmp_path / "model")
    assert main(["train", f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.tokenizer_path=builtin:tiny",
                 "actor_rollout_ref.model.warm_start.steps=80", "actor_rollout_ref.model.warm_start.cache=false",
                 "trainer.total_training_steps=30", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.logger=[console]", "trainer.save_freq=-1",
                 f"trainer.default_local_dir={tmp_path / 'run'}"]) == 0
    scores = scores_of(tmp_path / "run")
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last >= first + 0.04, f"{family}: reward went from {first:.2f} to {last:.2f} in {len(scores)} steps"
