"""Tests for lathe.rollout.hf.HFRollout on a tiny random Qwen2 model (see conftest.py)."""

import weakref
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lathe.generation import SamplingParams
from lathe.rollout.base import to_batch
from lathe.rollout.hf import HFRollout
from lathe.train.logprob import response_log_probs

from helpers import assert_close_rel

MAX = 8


def _rollout(model, tok, eos=None, **kw):
    return HFRollout(model, eos_token_id=tok.eos_token_id if eos is None else eos,
                     pad_token_id=tok.pad_token_id, **kw)


@torch.no_grad()
def _manual_greedy(model, prompt, max_tokens, stop_ids=()):
    """Argmax of a full forward over the unpadded sequence, one token at a time."""
    ids = list(prompt)
    new = []
    for _ in range(max_tokens):
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        new.append(nxt)
        if nxt in stop_ids:
            break
    return new


@torch.no_grad()
def _manual_log_probs(model, prompt, response, temperature):
    """log_softmax(logits / T) of each response token, from one teacher-forced forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_greedy_matches_manual_loop_on_ragged_prompts(make_model, tok, prompts):
    model = make_model()
    out = _rollout(model, tok).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX))
    expected = [_manual_greedy(model, p, MAX, stop_ids=(tok.eos_token_id,)) for p in prompts]
    assert out.token_ids == expected
    assert len({tuple(t) for t in expected}) > 1, "precondition: prompts give different continuations"
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")


def test_greedy_log_probs_are_at_temperature_one(make_model, tok, prompts):
    model = make_model()
    out = _rollout(model, tok).generate(prompts, SamplingParams(do_sample=False, temperature=0.5, max_tokens=4))
    for i, (p, r, lp) in enumerate(zip(prompts, out.token_ids, out.logprobs)):
        assert_close_rel(lp, _manual_log_probs(model, p, r, 1.0), name=f"log-probs of row {i}")


def test_sampled_log_probs_match_teacher_forced_forward(make_model, tok, prompts):
    model = make_model()
    T = 0.7
    params = SamplingParams(temperature=T, max_tokens=MAX, n=2, seed=3, ignore_eos=True)
    out = _rollout(model, tok).generate(prompts, params)
    batch = to_batch(prompts, out, tok.pad_token_id, n=2)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        trainer_lp, _ = response_log_probs(model, batch, temperature=T)
    assert_close_rel(batch["rollout_log_probs"][mask], trainer_lp[mask], name="log-probs vs the trainer's")
    # an independent computation, one unpadded sequence at a time
    rows = [p for p in prompts for _ in range(2)]
    for i, (p, r, lp) in enumerate(zip(rows, out.token_ids, out.logprobs)):
        assert_close_rel(lp, _manual_log_probs(model, p, r, T), name=f"log-probs of row {i}")
    # and the temperature matters: at T=1 the values differ
    lp_t1, _ = response_log_probs(model, batch, temperature=1.0)
    assert (lp_t1 - batch["rollout_log_probs"])[mask].abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_log_probs_of_rows_cut_by_eos_and_stop_strings_match_teacher_forced_forward(make_model, tok, prompts,
                                                                                    temperature):
    """Rows end early on an eos or a stop string; min_tokens bans the eos for two steps and top-k/top-p warp the
    sampling scores, yet each kept token's log-prob is log_softmax(raw logits / T) of a teacher-forced forward."""
    model = make_model()
    params = SamplingParams(temperature=temperature, top_k=8, top_p=0.9, max_tokens=MAX, min_tokens=2, n=3, seed=5)
    free = _rollout(model, tok).generate(prompts, replace(params, ignore_eos=True))
    eos = Counter(t for r in free.token_ids for t in set(r[2:])).most_common(1)[0][0]    # a token it often emits
    other = next(r for r in free.token_ids if eos not in r[2:])
    stop = tok.decode(other, skip_special_tokens=True)[3:5]                              # a string it writes
    out = _rollout(model, tok, eos=eos, tokenizer=tok).generate(prompts, replace(params, stop=[stop]))
    ends = [("eos" if r[-1] == eos else "stop") if reason == "stop" else reason
            for r, reason in zip(out.token_ids, out.finish_reasons)]
    assert {"eos", "stop"} <= set(ends), f"precondition: rows cut by an eos and by a stop string: {ends}"
    for row, (r, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        manual = _manual_log_probs(model, prompts[row // 3], r, params.logprob_temperature)
        assert_close_rel(lp, manual, name=f"log-probs of row {row}")


class _LiveLogits(TorchDispatchMode):
    """Peak bytes held at once in tensors shaped like logits, (rows, ..., vocabulary): the dispatch mode sees every
    tensor an op creates, and weak references tell which are still alive."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.rows, self.vocab, self.refs, self.peak = rows, vocab, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and (x.shape[0], x.shape[-1]) == (self.rows, self.vocab):
                self.refs.append(weakref.ref(x))
                live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in (r() for r in self.refs) if t is not None}
                self.peak = max(self.peak, sum(live.values()))
        return out


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_logits_held_do_not_grow_with_the_number_of_new_tokens(make_model, tok, prompts, temperature):
    """The logits alive at once (one step's: generate's own buffers and the log-prob capture's) do not grow with
    the generation; keeping every step's (output_logits) would take hundreds of GB at a 152k vocabulary."""
    rollout = _rollout(make_model(), tok)
    peaks = {}
    for max_tokens in (3, 12):
        params = SamplingParams(temperature=temperature, top_k=10, top_p=0.9, max_tokens=max_tokens, n=2, seed=0,
                                ignore_eos=True)
        with _LiveLogits(len(prompts) * 2, len(tok)) as probe:
            out = rollout.generate(prompts, params)
        assert [len(lp) for lp in out.logprobs] == [max_tokens] * len(out.logprobs)
        peaks[max_tokens] = probe.peak
    assert peaks[3] > 0, "precondition: the probe sees the logits"
    assert peaks[12] == peaks[3], f"logits held grow with the generation: {peaks}"


def test_finish_reason_stop_on_eos_includes_it_and_cuts(make_model, tok, prompts):
    model = make_model()
    free = _rollout(model, tok).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    eos = free.token_ids[0][2]          # a token the model emits: make it the eos
    out = _rollout(model, tok, eos=eos).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX))
    for full, ids, lps, reason in zip(free.token_ids, out.token_ids, out.logprobs, out.finish_reasons):
        if eos in full:
            cut = full.index(eos) + 1
            assert (ids, reason) == (full[:cut], "stop")
        else:
            assert (ids, reason) == (full, "length")
        assert len(lps) == len(ids)
    assert out.finish_reasons[0] == "stop" and len(out.token_ids[0]) <= 3


def test_stop_token_ids_and_ignore_eos(make_model, tok, prompts):
    model = make_model()
    free = _rollout(model, tok).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    stop = free.token_ids[1][1]
    out = _rollout(model, tok).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop]))
    assert out.finish_reasons[1] == "stop" and out.token_ids[1][-1] == stop
    assert len(out.token_ids[1]) <= 2
    # ignore_eos ignores the rollout's eos and stop_token_ids alike: every sample runs to max_tokens
    rollout = _rollout(model, tok, eos=stop)
    out = rollout.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[stop]))
    assert out.finish_reasons == ["length"] * len(prompts)
    assert [len(t) for t in out.token_ids] == [5] * len(prompts)
    assert [len(t) for t in out.logprobs] == [5] * len(prompts)


def test_seed_makes_sampling_reproducible_and_leaves_global_rng(make_model, tok, prompts):
    rollout = _rollout(make_model(), tok)
    params = SamplingParams(temperature=1.0, max_tokens=MAX, n=2, seed=11, ignore_eos=True)
    state = torch.get_rng_state()
    a = rollout.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), state)
    b = rollout.generate(prompts, params)
    c = rollout.generate(prompts, SamplingParams(temperature=1.0, max_tokens=MAX, n=2, seed=12, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_n_samples_are_prompt_major(make_model, tok, prompts):
    rollout = _rollout(make_model(), tok)
    one = rollout.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX))
    three = rollout.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, n=3))
    assert len(three.token_ids) == 3 * len(prompts)
    assert three.token_ids == [t for t in one.token_ids for _ in range(3)]
    # sampled: sample j of prompt i is row i*n + j; the log-probs follow that prompt
    sampled = rollout.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=0, ignore_eos=True))
    for row, (r, lp) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        assert_close_rel(lp, _manual_log_probs(rollout.model, prompts[row // 3], r, 1.0), name=f"row {row}")


def test_max_num_seqs_chunks_give_the_same_output(make_model, tok, prompts):
    model = make_model()
    params = SamplingParams(temperature=0, max_tokens=MAX, n=2)
    whole = _rollout(model, tok).generate(prompts, params)
    chunked = _rollout(model, tok, max_num_seqs=3).generate(prompts, params)
    assert chunked.token_ids == whole.token_ids and chunked.finish_reasons == whole.finish_reasons


def test_model_generation_config_does_not_leak(make_model, tok, prompts):
    clean = make_model()
    expected = _rollout(clean, tok).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    model = make_model()
    rollout = _rollout(model, tok)
    # Set after the rollout exists: a checkpoint or user code changing the config later must not leak either.
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.top_k = 3
    model.generation_config.temperature = 0.1
    model.generation_config.max_new_tokens = 2
    greedy = rollout.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert greedy.token_ids == expected.token_ids        # no repetition penalty, no max_new_tokens=2
    sampled = rollout.generate(prompts, SamplingParams(temperature=1.0, max_tokens=MAX, n=4, seed=0, ignore_eos=True))
    ranks = []
    for row, r in enumerate(sampled.token_ids):
        ids = torch.tensor([prompts[row // 4] + r])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompts[row // 4]) - 1:-1]
        chosen = logits.gather(-1, torch.tensor(r)[:, None])
        ranks += (logits > chosen).sum(-1).tolist()
    assert max(ranks) >= 3, "top_k=3 from the model's generation_config leaked into sampling"


def test_generate_restores_training_mode(make_model, tok, prompts):
    model = make_model().train()
    _rollout(model, tok).generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    assert model.training


def test_update_weights_copies_into_a_separate_model(make_model, tok, prompts):
    src, dst = make_model(seed=1), make_model(seed=2)
    rollout = _rollout(dst, tok)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert not torch.allclose(src(ids).logits, dst(ids).logits)
    rollout.update_weights(src.state_dict().items())
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst(ids).logits)
    for name, t in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], t)
        assert dst.state_dict()[name].data_ptr() != t.data_ptr()


def test_update_weights_rejects_unknown_names(make_model, tok):
    rollout = _rollout(make_model(), tok)
    with pytest.raises(KeyError, match="model.no_such.weight"):
        rollout.update_weights([("model.no_such.weight", torch.zeros(1))])


def test_update_weights_colocated_is_a_no_op(make_model, tok):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _rollout(model, tok).update_weights(model.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
