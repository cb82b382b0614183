"""Tests for lathe.workers.colocated_stream: the colocated engine's requests streamed across training steps
(colocate_async), CPU fp32, on tests/engine/test_stream.py's tiny random decoders (weights A, then B as version 1)."""

import time

import pytest
import torch

from engine.test_stream import P0, P1, P2, P3, _engine, _model, _teacher_forced
from helpers import assert_close_rel
from lathe.generation import SamplingParams
from lathe.workers.colocated_stream import ColocatedStream

PAD = 0
LONG = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
SHORT = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def weights():
    return {"A": _model(0), "B": _model(1)}


def _stream(engine, calls: list) -> ColocatedStream:
    def wake(timings):
        calls.append("wake")
        timings["timing_s/rollout_wake_up"] = timings.get("timing_s/rollout_wake_up", 0.0) + 1.0

    def sleep(timings):
        calls.append("sleep")
        timings["timing_s/rollout_sleep"] = timings.get("timing_s/rollout_sleep", 0.0) + 1.0
    return ColocatedStream(engine, PAD, wake=wake, sleep=sleep)


def test_interrupted_samples_continue_under_the_next_version_with_each_tokens_log_prob(weights):
    A, B = weights["A"], weights["B"]
    calls: list = []
    stream = _stream(_engine(A), calls)
    first = stream.run([("long", [P0], LONG, 0, None), ("short", [P1], SHORT, 2, None)], max_steps=4)
    assert [rid for rid, _ in first["done"]] == ["short"] and calls == ["wake"]
    short = first["done"][0][1]
    assert short.meta["rollout_metrics"]["timing_s/rollout_wake_up"] == 1.0     # the wake-up rides with it
    assert (short["rollout_versions"] == 0).all() and short["responses"].shape == (1, 2)
    assert stream.pause() == 2 and calls == ["wake", "sleep"]                     # the long request's two samples
    stream.load_weights(B.state_dict().items(), version=1)
    later = stream.run([("late", [P3], SHORT, 0, None)], max_steps=100)
    done = dict(later["done"])
    assert set(done) == {"long", "late"} and later["busy_s"] >= first["busy_s"] > 0
    carried = [b.meta["rollout_metrics"].get("timing_s/rollout_sleep") for b in done.values()]
    assert sorted(carried, key=str) == [1.0, None]                                # one of them carries the sleep
    assert (done["late"]["rollout_versions"] == 1).all()
    long = done["long"]
    for row in range(2):
        ids, versions = long["responses"][row].tolist(), long["rollout_versions"][row]
        switch = int((versions == 1).nonzero()[0])
        assert switch > 0 and (versions[:switch] == 0).all() and (versions[switch:] == 1).all()
        for model, span in ((A, slice(0, switch)), (B, slice(switch, None))):
            forced = _teacher_forced(model, P0, ids)
            assert_close_rel(long["rollout_log_probs"][row][span].tolist(), forced[span].tolist(), rel=1e-4,
                             name="log-probs of the span's weights")
    assert done["long"].meta["rollout_metrics"]["rollout/num_interrupted"] == 2


def test_a_blocking_generation_runs_beside_the_streamed_requests_and_leaves_them_to_the_next_run(weights):
    A = weights["A"]
    calls: list = []
    stream = _stream(_engine(A), calls)
    stream.run([("long", [P0], LONG, 0, None)], max_steps=2)
    stream.pause()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=11)
    out = stream.generate([P2, P1], params, first_index=4)
    ref = _engine(A).generate([P2, P1], params, first_index=4)
    assert out.token_ids == ref.token_ids
    assert calls == ["wake", "sleep", "wake", "sleep"] and not stream.awake      # paused again after it
    rest = stream.run([], max_steps=100)["done"]        # the streamed request ran on, beside it
    assert [rid for rid, _ in rest] == ["long"] and rest[0][1]["responses"].shape == (2, 12)


def test_weights_load_only_paused_and_a_pause_when_asleep_interrupts_nothing(weights):
    A, B = weights["A"], weights["B"]
    stream = _stream(_engine(A), [])
    assert stream.pause() == 0                                   # never woken: nothing to interrupt
    stream.run([("long", [P0], LONG, 0, None)], max_steps=2)
    stream.load_weights(B.state_dict().items(), version=1)      # pauses first (no sample holds old KV)
    assert not stream.awake and stream.engine.weight_version == 1
    done = dict(stream.run([], max_steps=100)["done"])
    assert (done["long"]["rollout_versions"][:, -1] == 1).all()


def test_the_rollout_refuses_streaming_where_it_cannot(weights):
    """A rollout with transformers' generate (or an agent loop on a tensor-parallel replica, or data-parallel
    attention) names the fix."""
    from lathe.workers.rollout import Rollout

    class Stub:
        name, agent, dp, stream, replica = "hf", None, None, None, None

        class tp:
            size = 1
    with pytest.raises(NotImplementedError, match="colocate_async.*trainer_mode=sync"):
        Rollout._stream(Stub())


def test_the_rollouts_timings_add_up_until_a_request_carries_them():
    """Two sleeps before a finished request carries them: both counted (`Rollout._timed` adds)."""
    from lathe.workers.rollout import Rollout
    rollout = object.__new__(Rollout)
    rollout.device = torch.device("cpu")
    into: dict = {}
    for _ in range(2):
        with rollout._timed(into, "timing_s/rollout_sleep"):
            time.sleep(0.01)
    assert into["timing_s/rollout_sleep"] >= 0.02
