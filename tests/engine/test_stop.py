"""lathe.generation.stop's rule as LatheEngine and HFRollout apply it: both cut at the same token."""

import pytest

from lathe.data.builtin import builtin_tokenizer
from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.generation.stop import StopStrings, first_stop
from lathe.rollout.hf import HFRollout

from helpers import assert_close_rel

from .conftest import PROMPTS

MAX = 12


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
