"""lathe: reinforcement-learning post-training of language models (PPO, GRPO and relatives)."""

__version__ = "0.1.0"
