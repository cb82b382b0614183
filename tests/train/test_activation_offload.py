"""verl's `model.enable_activation_offload` (`lathe.train.offload.activations_on_host`): what a training forward
saves for its backward waits in host memory and comes back for the backward; the gradients are the same."""

import contextlib

import pytest
import torch

from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train import offload
from lathe.train.logprob import response_log_probs

from .conftest import PAD, VOCAB


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 6)]
    responses = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (4, 6, 2)]
    return to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * 3), PAD, n=1)


def _grads(model, batch, offloaded: bool, device_type: str):
    model.zero_grad(set_to_none=True)
    with offload.activations_on_host(offloaded, device_type) as moved:
        logp, _ = response_log_probs(model, batch)
    (logp * batch["response_mask"]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, moved


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloaded_activations_give_the_same_gradients(make_lathe, monkeypatch, checkpointing):
    """On the CPU, 'offloaded' to other host memory (every saved tensor: no size floor): the same gradients, bit for
    bit; with gradient checkpointing the saved tensors include each decoder layer's input, never a parameter."""
    monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 0)
    model, batch = make_lathe(), _batch()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    want, _ = _grads(model, batch, False, "cpu")
    got, moved = _grads(model, batch, True, "cpu")
    assert moved["tensors"] >= model.config.num_hidden_layers and moved["bytes"] > 0
    assert all(torch.equal(got[n], want[n]) for n in want)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert moved["bytes"] < params or not checkpointing     # no parameter copied (checkpointing keeps the rest small)


def test_off_cuda_it_has_nothing_to_move(make_lathe, caplog):
    assert offload.activation_offload(True, torch.device("cpu"), key="k") is False
    assert "k has no effect on a cpu run" in caplog.text
    _, moved = _grads(make_lathe().train(), _batch(), True, "cuda")        # CPU tensors: none moved
    assert moved == {"tensors": 0, "bytes": 0}


class _Streams:
    """Stands in for `torch.cuda`'s streams and events on a CPU: waits are logged as (what, on, for)."""

    def __init__(self):
        self.log, self.now = [], None
        self.compute = _Stream(self, "compute")

    def Stream(self, device=None):
        return _Stream(self, "side")

    def Event(self):
        return _Event()

    def current_stream(self, device):
        return self.now or self.compute

    @contextlib.contextmanager
    def stream(self, stream):
        self.now = stream
        try:
            yield
        finally:
            self.now = None


class _Stream:
    def __init__(self, streams: _Streams, name: str):
        self.streams, self.name = streams, name

    def wait_stream(self, other: "_Stream"):
        self.streams.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "_Event"):
        self.streams.log.append(("wait_event", self.name, event))


class _Event:
    by = None                               # the stream that recorded it

    def record(self, stream: _Stream):
        self.by = stream.name


def test_the_side_stream_path_orders_every_copy_and_prefetches_in_the_backwards_order(make_lathe, monkeypatch):
    """The side stream's bookkeeping on a CPU, its stream calls stood in for (`_Streams`): each copy to the host
    waits for the compute stream and records its event; each read waits for the event of its own tensor's copy or of
    its prefetch (which waited for that copy) and holds what the side stream made for the compute stream. Through
    checkpointed layers every read after the first node's (the log-probs', read as the backward starts) finds its
    tensor prefetched, and nothing prefetched goes unread. The gradients are the same, bit for bit."""
    monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 0)
    streams = _Streams()
    monkeypatch.setattr(offload, "cuda", streams)
    monkeypatch.setattr(offload, "SIDE_STREAM", ("cpu",))
    monkeypatch.setattr(offload, "_COPY_STREAMS", {})
    held, hits = [], []
    monkeypatch.setattr(offload, "_hold", lambda t, stream: held.append(stream.name))
    take = offload._OnHost.take
    monkeypatch.setattr(offload._OnHost, "take", lambda self: hits.append(self.back is not None) or take(self))
    model, batch = make_lathe(), _batch()
    model.gradient_checkpointing_enable()
    model.train()
    want, _ = _grads(model, batch, False, "cpu")
    got, moved = _grads(model, batch, True, "cpu")
    assert all(torch.equal(got[n], want[n]) for n in want)
    n = moved["tensors"]
    assert n >= 3 * model.config.num_hidden_layers and len(hits) == n        # each layer's input, cos and sin
    log = streams.log
    assert [e for e in log if e[0] == "wait_stream"] == [("wait_stream", "side", "compute")] * n
    prefetches = [e for e in log if e[:2] == ("wait_event", "side")]         # each after its tensor's copy
    reads = [e for e in log if e[:2] == ("wait_event", "compute")]
    assert len(reads) == n and all(e[2].by == "side" for e in prefetches + reads)
    first = hits.index(True)
    assert 0 < first <= 4 and all(hits[first:]), hits      # one node's misses, then every read prefetched
    assert len(prefetches) == sum(hits) == held.count("compute")
    assert held.count("side") == n                          # each saved tensor held for its copy


@pytest.mark.gpu
def test_on_cuda_what_waits_for_the_backward_leaves_the_device_and_the_gradients_equal(make_lathe, monkeypatch):
    """Between the forward and the backward the device holds less by about what moved (the backward's own peak
    may not drop on a tiny model: there the logits' chunk, not the saved layer inputs, sets it)."""
    monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 0)
    model, batch = make_lathe().cuda(), _batch().to("cuda")
    model.gradient_checkpointing_enable()
    model.train()
    held, grads = [], []
    for offloaded in (False, True):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()          # the earlier pass's gradient copies are held: not counted
        with offload.activations_on_host(offloaded, "cuda") as moved:
            logp, _ = response_log_probs(model, batch)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        (logp * batch["response_mask"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert moved["tensors"] >= model.config.num_hidden_layers
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert held[0] - held[1] >= 0.5 * moved["bytes"] > 0, (held, moved)


@pytest.mark.gpu
def test_on_cuda_the_forward_does_not_wait_for_the_copies_to_host_memory(make_lathe, monkeypatch):
    """The copies to host memory run on a side stream: the offloaded forward makes no more synchronizing CUDA calls
    than the plain one (a blocking copy a saved tensor made one each), and the gradients are the same, bit for bit,
    with the forward's next kernels overwriting freed memory while the copies run; every read after the first node's
    finds its tensor prefetched."""
    import warnings
    monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 0)
    hits = []
    take = offload._OnHost.take
    monkeypatch.setattr(offload._OnHost, "take", lambda self: hits.append(self.back is not None) or take(self))
    model, batch = make_lathe().cuda(), _batch().to("cuda")
    model.gradient_checkpointing_enable()
    model.train()
    syncs, grads = [], []
    for offloaded in (False, True):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with offload.activations_on_host(offloaded, "cuda") as moved:
                    logp, _ = response_log_probs(model, batch)
                    scratch = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]   # reuse
            finally:
                torch.cuda.set_sync_debug_mode(0)
        del scratch
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        (logp * batch["response_mask"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert moved["tensors"] >= model.config.num_hidden_layers
    assert syncs[1] <= syncs[0], syncs
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    first = hits.index(True)                # read on autograd's device thread as on the CPU: prefetched after one node
    assert len(hits) == moved["tensors"] and 0 < first <= 4 and all(hits[first:]), hits


def test_an_actor_update_with_offload_updates_the_same_and_reports_what_it_moved(make_lathe, rollout_batch, load_cfg,
                                                                                  monkeypatch):
    """The actor's update with `offload_activations` (its tensors 'offloaded' to other CPU memory here): the same
    weights, and `perf/activation_offload_gb` says how much waited in host memory per optimizer step."""
    import functools

    from lathe.config import batch_plan
    from lathe.train import actor as actor_module
    from lathe.train.optim import build_optimizer, build_scheduler
    monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 0)
    monkeypatch.setattr(actor_module, "activations_on_host",
                        functools.partial(offload.activations_on_host, device_type="cpu"))
    cfg = load_cfg("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    arr, batch = cfg.actor_rollout_ref, rollout_batch(rows=8)
    batch["old_log_probs"] = torch.zeros(batch["response_mask"].shape)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(1))
    results = []
    for offloaded in (False, True):
        model = make_lathe()
        model.gradient_checkpointing_enable()
        optimizer = build_optimizer(model.parameters(), arr.actor.optim)
        ppo = actor_module.PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10),
                                    arr.actor, mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                                    temperature=1.0, max_response_length=cfg.data.max_response_length,
                                    offload_activations=offloaded)
        metrics = ppo.update_policy(batch)
        results.append(({k: v.detach().clone() for k, v in model.named_parameters()}, metrics))
    (plain, plain_metrics), (moved, moved_metrics) = results
    assert all(torch.equal(plain[k], moved[k]) for k in plain)
    assert "perf/activation_offload_gb" not in plain_metrics and moved_metrics["perf/activation_offload_gb"] > 0
