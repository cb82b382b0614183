"""Tests for lathe.engine.stop (stop strings) and its use by LatheEngine and HFRollout."""

import random

import pytest

from lathe.data.builtin import builtin_tokenizer
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.stop import StopStrings, check_stop_strings, decode_texts, first_stop, stop_text, text_decoder
from lathe.rollout.base import SamplingParams
from lathe.rollout.hf import HFRollout

from helpers import assert_close_rel

from .conftest import PROMPTS

MAX = 12


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


# ---- engine and HF rollout -------------------------------------------------------------------------


def _engine(path, tok=None):
    return LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64, tokenizer=tok)


def test_engine_stops_on_a_string_from_an_unconstrained_run(checkpoints):
    path, _ = checkpoints["qwen2"]
    tok = builtin_tokenizer()
    engine = _engine(path, tok)
    free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    text = tok.decode(free.token_ids[0], skip_special_tokens=True)
    stop = text[4:6]                                   # occurs in prompt 0's output, completed by token <= 6
    first = first_stop(free.token_ids[0], StopStrings.from_tokenizer([stop], tok))
    assert first is not None and first < MAX, "precondition"
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX, stop=[stop]))
    for i, ids in enumerate(free.token_ids):
        k = first_stop(ids, StopStrings.from_tokenizer([stop], tok))
        end = MAX if k is None else k
        assert out.token_ids[i] == ids[:end]
        # the batch shrinks at other steps once a row stops: the same log-probs up to rounding
        assert_close_rel(out.logprobs[i], free.logprobs[i][:end], name=f"log-probs of row {i}")
        assert out.finish_reasons[i] == ("length" if k is None else "stop")
    assert out.finish_reasons[0] == "stop"
    assert tok.decode(out.token_ids[0], skip_special_tokens=True).endswith(stop)
    assert stop not in tok.decode(out.token_ids[0][:-1], skip_special_tokens=True)


def test_engine_stop_without_tokenizer_is_refused(checkpoints):
    path, _ = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="tokenizer"):
        _engine(path).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, stop=["a"]))


def test_hf_rollout_cuts_at_the_same_token_as_the_engine(checkpoints):
    path, hf = checkpoints["qwen2"]
    tok = builtin_tokenizer()
    free = _engine(path, tok).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    stops = [tok.decode(free.token_ids[0], skip_special_tokens=True)[3:5],
             tok.decode(free.token_ids[3], skip_special_tokens=True)[6:8]]
    for min_tokens in (0, 5):
        params = SamplingParams(temperature=0, max_tokens=MAX, stop=stops, min_tokens=min_tokens)
        ours = _engine(path, tok).generate(PROMPTS, params)
        theirs = HFRollout(hf, eos_token_id=[], pad_token_id=0, tokenizer=tok).generate(PROMPTS, params)
        assert theirs.token_ids == ours.token_ids and theirs.finish_reasons == ours.finish_reasons
        assert ours.finish_reasons.count("stop") >= 2
    with pytest.raises(ValueError, match="tokenizer"):
        HFRollout(hf, eos_token_id=[], pad_token_id=0).generate(PROMPTS, SamplingParams(stop=["a"]))
