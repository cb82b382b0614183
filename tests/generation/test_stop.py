"""Tests for lathe.generation.stop: the windowed matcher against decoding the whole output, and the decoders."""

import random

import pytest

from lathe.data.builtin import builtin_tokenizer
from lathe.generation.stop import StopStrings, check_stop_strings, decode_texts, first_stop, stop_text, text_decoder


def _byte_tokens(text: str, rng: random.Random) -> tuple[list[int], callable]:
    """Byte-level BPE-like: `text` cut into chunks of 1-4 bytes (characters split across tokens)."""
    data, vocab, ids, i = text.encode("utf-8"), [], [], 0
    while i < len(data):
        k = rng.randint(1, 4)
        vocab.append(data[i:i + k])
        ids.append(len(vocab) - 1)
        i += k
    return ids, lambda toks: b"".join(vocab[t] for t in toks).decode("utf-8", errors="replace")


def _metaspace_tokens(text: str, rng: random.Random) -> tuple[list[int], callable]:
    """SentencePiece-like: spaces become "\u2581" inside pieces; a decode drops the text's leading space."""
    data, vocab, ids, i = text.replace(" ", "\u2581"), [], [], 0
    while i < len(data):
        k = rng.randint(1, 3)
        vocab.append(data[i:i + k])
        ids.append(len(vocab) - 1)
        i += k
    return ids, lambda toks: "".join(vocab[t] for t in toks).replace("\u2581", " ").removeprefix(" ")


def _whole_text_rule(ids, decode, stop, min_tokens):
    """Reference: decode the WHOLE output at every step; a match must end in the newest token's text."""
    prev = ""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        common = len(prev) if text.startswith(prev) else next(
            (i for i, (a, b) in enumerate(zip(prev, text)) if a != b), min(len(prev), len(text)))
        prev = text
        if n >= min_tokens and any(text.find(s, max(0, common - len(s) + 1)) >= 0 for s in stop):
            return n
    return None


@pytest.mark.parametrize("tokens", [_byte_tokens, _metaspace_tokens])
@pytest.mark.parametrize("token_filter", [False, True])
def test_windowed_matcher_agrees_with_decoding_the_whole_output(tokens, token_filter):
    rng = random.Random(0)
    alphabet = list("ab c\n") + ["é", "✓", "😀", "ß"]
    hits = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 200)))
        ids, decode = tokens(text, rng)
        stop = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stop.append(text[a:a + rng.randint(1, 4)])
        min_tokens = rng.choice([0, 0, 5, 30])
        expected = _whole_text_rule(ids, decode, stop, min_tokens)
        got = first_stop(ids, StopStrings(stop, decode, token_filter=token_filter), min_tokens=min_tokens)
        assert got == expected, (text, stop, min_tokens)
        hits += expected is not None and expected > 40    # found after the window had to move
    assert hits > 20, "precondition: many matches lie beyond the first window"


def test_stop_spanning_tokens_and_overhanging_the_last_one():
    vocab = ["Hel", "lo", " wor", "ld", "!\n\n", "x"]
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    stops = lambda *s: StopStrings(s, decode, token_filter=True)  # noqa: E731
    assert first_stop([0, 1, 2, 3, 4], stops("o wo")) == 3          # spans "lo" + " wor"
    assert first_stop([0, 1, 2, 3, 4], stops("\n")) == 5
    assert stop_text([0, 1, 2, 3, 4], ["\n"], decode) == "Hello world!\n"    # cut after the stop string
    assert stop_text([0, 1, 2, 3], ["\n"], decode) == "Hello world"           # no stop: whole text
    assert first_stop([0, 1, 2, 3], stops("zzz")) is None
    # min_tokens: "lo" completes at token 2, too early; the next "l" is in "ld" (token 4)
    assert first_stop([0, 1, 2, 3, 4], stops("l"), min_tokens=3) == 4
    assert first_stop([0, 1, 2, 3, 4], stops("l")) == 1
    assert [stops("\n").may_end(t) for t in range(6)] == [False, False, False, False, True, False]


def test_matcher_counts_only_the_output_and_each_match_once():
    vocab = ["a", "b", "c"]
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    prompt = [0, 1]                                     # "ab" in the prompt must not count
    m = StopStrings(["ab"], decode).matcher(prompt_len=len(prompt))
    ids = list(prompt)
    results = []
    for t in [1, 2, 0, 1]:
        ids.append(t)
        results.append(m.check(ids))
    assert results == [False, False, False, True]


def test_bad_stop_strings_are_named():
    with pytest.raises(ValueError, match="list of strings"):
        check_stop_strings("###")
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings(["ok", ""])


def test_text_decoder_equals_tokenizer_decode():
    tok = builtin_tokenizer()
    ids = tok.encode("12+7=19") + [tok.eos_token_id] + tok.encode(" x\n")
    assert text_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True) == "12+7=19 x\n"


def test_decode_texts_equals_tokenizer_decode_row_by_row():
    tok = builtin_tokenizer()
    rows = [tok.encode("12+7=19") + [tok.eos_token_id] + tok.encode(" x\n"), [], tok.encode("3 * 4 = 12")]
    expected = [tok.decode(r, skip_special_tokens=True) for r in rows]
    assert decode_texts(tok, rows) == expected == ["12+7=19 x\n", "", "3 * 4 = 12"]
    tok.clean_up_tokenization_spaces = True        # transformers' own post-processing: decoded row by row
    assert decode_texts(tok, rows) == [tok.decode(r, skip_special_tokens=True) for r in rows]
