"""Tests for lathe.generation.sampling: SamplingParams properties."""

from lathe.generation import SamplingParams


def test_sampling_params_greedy_and_logprob_temperature():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(do_sample=False, temperature=0.7).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(do_sample=False, temperature=0.7).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.7).logprob_temperature == 0.7
