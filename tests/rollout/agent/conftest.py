"""A Qwen2.5-style tokenizer for the agent-loop tests (`helpers.qwen_style_tokenizer`)."""

import pytest

from helpers import qwen_style_tokenizer

@pytest.fixture(scope="session")
def qwen_tok():
    return qwen_style_tokenizer()
