"""Tiny fp32 Qwen2 models, verl-keyed actor configs and rollout-layout batches for the train tests."""

import pytest
import torch

from lathe.config import load_config
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch

VOCAB = 40
PAD = 0
# Norm-relative tolerance for parameter updates of two fp32 paths (micro-batched vs whole, packed vs padded,
# compiled vs eager). The gradients sum per-token terms of both signs (random advantages, returns), so their
# rounding is a larger share of the result than in a forward: up to ~2e-6 here.
UPDATE_REL = 3e-5

# 4 prompts x rollout.n=2 = 8 sequences per step; ppo_mini_batch_size=2 prompts -> 2 mini-batches of 4.
BASE_OVERRIDES = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3"]


@pytest.fixture
def make_model():
    def make(seed: int = 0):
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                          eos_token_id=1, pad_token_id=PAD)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return Qwen2ForCausalLM(cfg)
    return make


@pytest.fixture
def make_lathe(make_model):
    """make_lathe(seed=0) -> lathe's decoder holding the weights of make_model(seed)."""
    from lathe.models.hf import lathe_from_transformers
    return lambda seed=0: lathe_from_transformers(make_model(seed))


@pytest.fixture
def load_cfg():
    """load_cfg(*overrides) -> the full config with the tiny batch sizes above."""
    return lambda *overrides: load_config(None, [*BASE_OVERRIDES, *overrides])


@pytest.fixture
def rollout_batch():
    """rollout_batch(rows=8, seed=0) -> `to_batch` output with ragged random prompts and responses."""
    def make(rows: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(rows)]
        responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(rows)]
        out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * rows)
        return to_batch(prompts, out, PAD, n=1)
    return make


class StreamLog:
    """Fake streams for `lathe.train.master.StreamedAdam` on the CPU, and a race check over what it queued.

    The stream helpers it imports from `lathe.device` are replaced by ones that keep a vector clock per stream (a
    record copies the stream's clock into the event, a wait takes the maximum), and its `_copy` and `adam` log the
    byte ranges they read and write, with the stream current then and its clock (the tensors are kept, so no address
    is reused). Operation A happens before B on the device when B's stream has seen A's position: `before(a, b)`.

    The caching allocator is modelled too: a device buffer (`_Slot.buffer`) is taken and given back on the compute
    stream, and the allocator hands its bytes to the compute stream's next allocation at once, ordered after what
    that stream has queued only (no `record_stream` here). So its taking and its freeing are logged as writes of all
    its bytes on the compute stream ("alloc", "free"): a side stream's copy into it before it was taken, or out of it
    not joined before it is freed, is a race."""

    class Event:
        def __init__(self, clock: dict):
            self.clock = clock

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 0.0

    def __init__(self, monkeypatch):
        import contextlib

        from lathe.train import master
        self.current, self.clocks, self.log = "compute", {"compute": {"compute": 0}}, []
        real_copy, real_adam = master._copy, master.adam

        def copy(dst, src):
            self.access([src], [dst], "copy")
            real_copy(dst, src)

        def adam(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, **kwargs):
            self.access(grads, [*params, *exp_avgs, *exp_avg_sqs, *steps], "adam")
            real_adam(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, **kwargs)

        @contextlib.contextmanager
        def stream_context(stream):
            before, self.current = self.current, stream if stream is not None else self.current
            try:
                yield
            finally:
                self.current = before
        log = self

        class Slot(master._Slot):
            def __setattr__(slot, name, value):
                old = slot.__dict__.get(name)
                if name == "buffer" and old is not None and old is not value:
                    log.on_compute([old], "free")
                object.__setattr__(slot, name, value)
                if name == "buffer" and value is not None and old is not value:
                    log.on_compute([value], "alloc")

        real_finish = master.StreamedAdam.finish

        def finish(stream):
            held = [slot.buffer for slot in stream.slots if slot.buffer is not None]
            real_finish(stream)
            if stream.started is not None:       # (`finish` drops the slots: their buffers are freed there)
                self.on_compute(held, "free")
        for name, fake in (("current_stream", lambda device: "compute"), ("new_stream", self.new_stream),
                           ("stream_context", stream_context), ("record_event", self.record_event),
                           ("wait_event", self.wait_event), ("wait_stream", self.wait_stream),
                           ("_copy", copy), ("adam", adam), ("_Slot", Slot)):
            monkeypatch.setattr(master, name, fake)
        monkeypatch.setattr(master.StreamedAdam, "finish", finish)

    def new_stream(self, device) -> str:
        name = f"side{len(self.clocks)}"
        self.clocks[name] = {name: 0}
        return name

    def _tick(self, stream: str) -> dict:
        self.clocks[stream][stream] += 1
        return dict(self.clocks[stream])

    def record_event(self, stream, *, timing: bool = False):
        return None if stream is None else self.Event(self._tick(stream))

    def wait_event(self, stream, event) -> None:
        if stream is not None and event is not None:
            clock = self.clocks[stream]
            for k, v in event.clock.items():
                clock[k] = max(clock.get(k, 0), v)

    def wait_stream(self, stream, other) -> None:
        if stream is not None and other is not None:
            self.wait_event(stream, self.record_event(other))

    def access(self, reads, writes, what: str) -> dict:
        entry = {"stream": self.current, "clock": self._tick(self.current), "what": what,
                 "tensors": [(t, False) for t in reads] + [(t, True) for t in writes]}
        self.log.append(entry)
        return entry

    def on_compute(self, buffers, what: str) -> None:
        """The allocator's taking or freeing of `buffers` (on the compute stream, whatever stream is current)."""
        if buffers:
            before, self.current = self.current, "compute"
            self.access([], buffers, what)
            self.current = before

    @staticmethod
    def before(a: dict, b: dict) -> bool:
        return a["clock"][a["stream"]] <= b["clock"].get(a["stream"], 0)

    def buffers(self, stream: str) -> list[set[int]]:
        """The storages written by each run of consecutive operations on `stream` (a chunk's copies in)."""
        runs: list[set[int]] = []
        for i, entry in enumerate(self.log):
            if entry["stream"] == stream:
                if i == 0 or self.log[i - 1]["stream"] != stream:
                    runs.append(set())
                runs[-1].update(t.untyped_storage().data_ptr() for t, written in entry["tensors"] if written)
        return runs

    def double_buffered(self, stream: str) -> bool:
        """Whether the chunks copied in on `stream` used two buffers in turn: each chunk one buffer, not its
        predecessor's, either the one of two chunks before or a new one, and a buffer left is never used again
        (the device held two chunks' buffers at most; the tensors are kept here, so an address is not reused)."""
        seen: set[int] = set()
        chunks = [next(iter(run)) if len(run) == 1 else None for run in self.buffers(stream)]
        for c, buffer in enumerate(chunks):
            if buffer is None or c and buffer == chunks[c - 1]:
                return False
            if c > 1 and buffer != chunks[c - 2] and buffer in seen:
                return False
            seen.add(buffer)
        return True

    def races(self) -> list[tuple[dict, dict]]:
        """Pairs of operations on different streams, one writing bytes the other touches, where the one queued
        first does not happen before the other on the device."""
        def spans(entry):
            return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), w)
                    for t, w in entry["tensors"] if t.numel()]
        out = []
        for i, a in enumerate(self.log):
            for b in self.log[i + 1:]:
                if a["stream"] != b["stream"] and not self.before(a, b) and any(
                        s < e2 and s2 < e and (w or w2) for s, e, w in spans(a) for s2, e2, w2 in spans(b)):
                    out.append((a, b))
        return out


@pytest.fixture
def stream_log(monkeypatch):
    """`StreamLog`: StreamedAdam's streams faked on the CPU, what it queues logged with vector clocks."""
    return StreamLog(monkeypatch)
