"""Built-in task and tokenizer: lets lathe train end to end with no download.

`builtin_tokenizer()` is a character-level tokenizer over printable ASCII with a tiny chat
template; `arithmetic_rows()` makes a verl-schema arithmetic data set ("12+7=" -> "19"), and
`lathe.data.secret_lookup` a tool-calling one (`BUILTIN_DATASETS` names them `builtin:<task>`).
Together with a tiny model built in code they give a task a few-million-parameter policy can
learn in minutes on a CPU, which is what the smoke and integration tests need.

Conversation format (the chat template)::

    <|user|>12+7=<|end|><|assistant|>        # prompt, add_generation_prompt=True
    19<|endoftext|>                          # response: answer characters, then eos

A response ends with eos (`<|endoftext|>`), never `<|end|>`: one stop token, as in verl's
single-turn rollouts. `<|end|>` only closes messages rendered by the template.
"""

from __future__ import annotations

import random
import string
from typing import Any, Callable

from lathe.data.secret_lookup import secret_lookup_rows

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_TOKEN = "<|end|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS, END_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

ARITHMETIC_DATA_SOURCE = "lathe/arithmetic"
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def builtin_tokenizer():
    """Character-level `PreTrainedTokenizerFast`: one token per printable ASCII character.

    Ids: 0 `<|pad|>`, 1 `<|endoftext|>` (eos), 2 `<|unk|>`, 3-5 role tokens, 6 `<|end|>`,
    then `string.printable` in order (107 tokens in all). Any other character encodes to
    `<|unk|>`. A BPE model with no merges splits text into single characters; the Fuse decoder
    joins them back without added spaces, so decode(encode(s)) == s for printable ASCII.
    Survives save_pretrained + AutoTokenizer.from_pretrained (tokenizer.json + chat template).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[*ROLE_TOKENS, END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _check_arithmetic_args(n: int, max_operand: int, ops) -> tuple[str, ...]:
    """Validate arithmetic_rows arguments; return ops as a tuple."""
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    bad = [op for op in ops if op not in _OPS]
    if not ops or bad:
        raise ValueError(
            f"arithmetic_rows: unsupported ops {bad or ops!r}; use a non-empty subset of {tuple(_OPS)}"
        )
    if n < 0:
        raise ValueError(f"arithmetic_rows: n must be >= 0, got {n}")
    if max_operand < 1:
        raise ValueError(f"arithmetic_rows: max_operand must be >= 1, got {max_operand}")
    return ops


def arithmetic_rows(
    n: int, seed: int, split: str, max_operand: int = 30, ops=("+",)
) -> list[dict[str, Any]]:
    """`n` arithmetic problems in verl's row schema, deterministic in `seed`.

    Operands are uniform integers in [0, max_operand]; the operator is uniform over `ops`.
    For "-" the operands are ordered so the answer is never negative (fewer characters for a
    tiny model to learn). Prompt "a<op>b=", ground truth the decimal answer as a string.
    Use different seeds for train and test; with a small operand range the splits overlap.
    """
    ops = _check_arithmetic_args(n, max_operand, ops)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = ops[rng.randrange(len(ops))]
        if op == "-" and a < b:
            a, b = b, a
        answer = str(_OPS[op](a, b))
        rows.append(
            {
                "data_source": ARITHMETIC_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": i, "answer": answer},
            }
        )
    return rows


_EVAL_SPLITS = ("val", "validation", "test")
BUILTIN_MAX_OPERAND = 9   # single-digit sums: learnable by RL on two CPU cores in minutes


def _split_rows(name: str, split: str, train: Callable[[], list], evaluation: Callable[[], list]) -> list:
    if split == "train":
        return train()
    if split in _EVAL_SPLITS:
        return evaluation()
    raise ValueError(f"{name}: unknown split {split!r}; use 'train' or one of {_EVAL_SPLITS}")


def builtin_arithmetic(split: str) -> list[dict[str, Any]]:
    """The `builtin:arithmetic` data set: train 4096 rows (seed 0), val/test 256 rows (seed 1)."""
    return _split_rows("builtin:arithmetic", split,
                       lambda: arithmetic_rows(4096, seed=0, split=split, max_operand=BUILTIN_MAX_OPERAND),
                       lambda: arithmetic_rows(256, seed=1, split=split, max_operand=BUILTIN_MAX_OPERAND))


def builtin_secret_lookup(split: str) -> list[dict[str, Any]]:
    """The `builtin:secret_lookup` agent task (`lathe.data.secret_lookup`): train 512 rows (seed 0), val/test 32
    rows (seed 1)."""
    return _split_rows("builtin:secret_lookup", split, lambda: secret_lookup_rows(512, seed=0, split=split),
                       lambda: secret_lookup_rows(32, seed=1, split=split))


BUILTIN_DATASETS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "builtin:arithmetic": builtin_arithmetic,
    "builtin:secret_lookup": builtin_secret_lookup,
}
