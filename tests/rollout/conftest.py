"""A tiny random Qwen2 model and the built-in tokenizer for the rollout tests.

`initializer_range` is raised above the default so the logits are far from uniform: greedy decoding
then produces varied, context-dependent tokens and ties in argmax are practically impossible.
"""

import pytest
import torch

from lathe.data.builtin import builtin_tokenizer


@pytest.fixture(scope="session")
def tok():
    return builtin_tokenizer()


@pytest.fixture
def make_model(tok):
    def make(seed: int = 0):
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return Qwen2ForCausalLM(cfg).eval()
    return make


@pytest.fixture
def prompts(tok):
    """Ragged prompts (lengths 5, 2, 7 and 4)."""
    return [tok.encode(s) for s in ("12+7=", "3=", "100*20=", "8-1=")]
