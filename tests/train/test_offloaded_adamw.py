"""Tests for lathe.train.offloaded_adamw.OffloadedAdamW: AdamW with its moments in host memory, streamed through
the parameters' device in chunks (verl's `optimizer_offload` on FSDP2 shards).

The reference is torch's own `torch.optim.AdamW` fed the same gradients: on plain tensors, then on FSDP2 shards of 2
gloo ranks (clipped, checkpointed with torch.distributed.checkpoint both ways). On a CPU the moments are ordinary host
tensors, streamed all the same (copied in and back); the GPU test checks they are pinned host memory on CUDA.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel, free_port, gloo_rank, spawn_saving_ranks
from torch import nn

from lathe.train.master import MOMENTS
from lathe.train.offloaded_adamw import OffloadedAdamW
from lathe.train.optim import build_optimizer

HPARAMS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = ((5, 7), (13,), (3,), (2, 3, 4))
CHUNK = 6                 # smaller than most tensors: the streaming cuts them across chunks
REL = 1e-6


def _params(seed: int = 0, device: str = "cpu") -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(step: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def _run(opt, params, steps) -> None:
    for step in steps:
        for p, grad in zip(params, _grads(step, params[0].device.type)):
            p.grad = grad
        opt.step()
        opt.zero_grad()


def _assert_same(opt, params, ref_opt, ref_params) -> None:
    assert_close_rel(torch.cat([p.detach().flatten() for p in params]),
                     torch.cat([p.detach().flatten() for p in ref_params]), REL, "params")
    for k in MOMENTS:
        assert_close_rel(torch.cat([opt.state[p][k].flatten() for p in params]),
                         torch.cat([ref_opt.state[p][k].flatten() for p in ref_params]), REL, k)
    assert [float(opt.state[p]["step"]) for p in params] == [float(ref_opt.state[p]["step"]) for p in ref_params]


def _pair(steps: int, device: str = "cpu"):
    """An offloaded and a resident optimizer over the same tensors, `steps` steps each: (params, offloaded,
    reference params, reference)."""
    params, ref_params = _params(device=device), _params(device=device)
    opt = OffloadedAdamW(params, chunk_numel=CHUNK, **HPARAMS)
    ref = torch.optim.AdamW(ref_params, **HPARAMS)
    _run(opt, params, range(steps))
    _run(ref, ref_params, range(steps))
    return params, opt, ref_params, ref


def test_step_equals_torch_adamw_with_tensors_cut_across_chunks():
    params, opt, ref_params, ref = _pair(4)
    _assert_same(opt, params, ref, ref_params)
    assert all(opt.state[p][k] is not p and opt.state[p][k].device.type == "cpu" for p in params for k in MOMENTS)


def test_the_streaming_on_fake_streams_races_nothing_and_holds_two_chunks(stream_log):
    """The chunks (tensors cut across them, moments in packed host buffers) on StreamedAdam's fake streams
    (tests/train/conftest.py), 3 steps: no two operations touching the same bytes on different streams unordered on
    the device, two device buffers a step, the numbers of one chunk a step (bit for bit) and of torch's AdamW."""
    params, opt, ref_params, ref = _pair(3)
    assert not stream_log.races()
    last = opt.last_stream
    assert stream_log.double_buffered(last.h2d) and last.chunks == -(-sum(p.numel() for p in params) // CHUNK)
    _assert_same(opt, params, ref, ref_params)
    whole_params = _params()
    whole = OffloadedAdamW(whole_params, chunk_numel=1 << 20, **HPARAMS)
    _run(whole, whole_params, range(3))
    assert whole.last_stream.chunks == 1
    assert all(torch.equal(a, b) for a, b in zip(params, whole_params))
    assert all(torch.equal(opt.state[a][k], whole.state[b][k]) for a, b in zip(params, whole_params) for k in MOMENTS)


def test_a_step_that_fails_midway_still_joins_the_copies_it_queued(stream_log):
    """A step that raises after streaming some chunks (here the second group's amsgrad) still joins the side streams
    into the compute stream (`StreamedAdam.finish`): its device buffers go back to the allocator, which hands them to
    the compute stream's next allocation at once, so a write-back still reading them would copy garbage into the
    host moments, and the next step's copies in would not wait for the write-backs."""
    params = _params()
    opt = OffloadedAdamW([{"params": params[:2]}, {"params": params[2:], "amsgrad": True}], chunk_numel=CHUNK,
                         **HPARAMS)
    for p, grad in zip(params, _grads(0)):
        p.grad = grad
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    side = [e for e in stream_log.log if e["stream"] != "compute"]
    assert side, "the first group streamed"
    joined = {"stream": "compute", "clock": dict(stream_log.clocks["compute"])}
    assert all(stream_log.before(e, joined) for e in side), "the side streams' copies were never joined"


def test_state_dict_round_trips_with_torch_adamw_both_ways():
    """The layouts are the same: either optimizer resumes the other's state and goes on as if never stopped."""
    params, opt, ref_params, ref = _pair(2)
    saved, ref_saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())   # as a checkpoint holds them
    assert saved["param_groups"] == ref_saved["param_groups"]
    assert {i: sorted(s) for i, s in saved["state"].items()} == {i: sorted(s) for i, s in ref_saved["state"].items()}
    assert all(saved["state"][i]["step"].dtype == ref_saved["state"][i]["step"].dtype for i in saved["state"])

    # offloaded -> resident, resident -> offloaded, each continuing beside the original
    to_ref_params, to_off_params = [p.detach().clone().requires_grad_() for p in params], _params()
    with torch.no_grad():
        for p, q in zip(to_off_params, ref_params):
            p.copy_(q)
    to_ref = torch.optim.AdamW(to_ref_params, **HPARAMS)
    to_ref.load_state_dict(saved)
    to_off = OffloadedAdamW(to_off_params, chunk_numel=CHUNK, **HPARAMS)
    to_off.load_state_dict(ref_saved)
    for o, ps in ((opt, params), (ref, ref_params), (to_ref, to_ref_params), (to_off, to_off_params)):
        _run(o, ps, range(2, 4))
    _assert_same(to_ref, to_ref_params, opt, params)
    _assert_same(to_off, to_off_params, ref, ref_params)


def test_host_memory_is_taken_in_power_of_two_buffers(monkeypatch):
    """torch's caching host allocator rounds every pinned allocation up to a power of two: one buffer of all the
    moments (2^21 + 1072 elements here) would take twice their size (2^22). The buffers are powers of two, except a
    last one under `MIN_BUFFER_BYTES`, and hold the moments, each whole, none overlapping, with little to spare."""
    import lathe.train.master as master
    import lathe.train.offloaded_adamw as mod
    sizes = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        sizes.append(t.numel() * t.element_size())
        return t
    monkeypatch.setattr(mod.torch, "empty", empty)
    monkeypatch.setattr(master, "MIN_BUFFER_BYTES", 1 << 12)
    shapes = [(1 << 20,), (1 << 18, 2), (2, 1 << 18), (5, 7), (13,), (0, 4), (1 << 10,)]
    params = [nn.Parameter(real_empty(s)) for s in shapes]
    host = mod._host_moments(params)
    monkeypatch.undo()
    need = sum(p.numel() * 4 for p in params)
    small = [n for n in sizes if n & (n - 1)]            # not a power of two
    assert len(small) <= 2 and all(n < 1 << 12 for n in small), sizes     # at most one per moment, under the min
    assert sum(sizes) <= 1.01 * 2 * need, (sum(sizes), 2 * need)
    for k in MOMENTS:
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in (host[p][k] for p in params) if t.numel())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "views overlap"
        assert [host[p][k].shape for p in params] == [p.shape for p in params]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_equals_torch_adamw_with_the_moments_in_several_buffers(monkeypatch, device):
    """The moments in two host buffers (a 64-byte smallest buffer: 64 and 13 elements) update as torch's do."""
    import lathe.train.master as master
    monkeypatch.setattr(master, "MIN_BUFFER_BYTES", 64)
    params, opt, ref_params, ref = _pair(4, device)
    opt.state_dict()                                # waits for the copies back to host memory
    _assert_same(opt, params, ref, ref_params)
    storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params}
    assert len(storages) == 2


def test_build_optimizer_picks_it_on_the_sharded_path_only_for_state_offload():
    from lathe.config import load_config
    cfg = load_config(None).actor_rollout_ref.actor.optim
    assert isinstance(build_optimizer(_params(), cfg, sharded=True, offload_state=True), OffloadedAdamW)
    assert type(build_optimizer(_params(), cfg, sharded=True)) is torch.optim.AdamW
    # param offload on FSDP2 (CPUOffloadPolicy) puts the shards and their state in host memory already
    assert type(build_optimizer(_params(), cfg, sharded=True, offload_params=True, offload_state=True)) \
        is torch.optim.AdamW


def test_offload_flags_on_the_sharded_path_count_fsdp2s_offload_policy_as_param_offload():
    from types import SimpleNamespace

    from lathe.train.offload import offload_flags
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fsdp = lambda **kw: SimpleNamespace(**{"param_offload": False, "optimizer_offload": True,  # noqa: E731
                                           "offload_policy": False, **kw})
    assert offload_flags(fsdp(), cuda, key="k", sharded=True) == {"offload_params": False, "offload_state": True}
    assert offload_flags(fsdp(offload_policy=True), cuda, key="k", sharded=True)["offload_params"]
    assert not offload_flags(fsdp(offload_policy=True), cuda, key="k")["offload_params"]   # one device: no FSDP2
    assert offload_flags(fsdp(), cpu, key="k", sharded=True) == {"offload_params": False, "offload_state": False}


# -- FSDP2 shards on 2 gloo ranks -------------------------------------------------------------------------------
def _sharded_net():
    """Linear layers of odd sizes (uneven shards over 2 ranks), the same weights on every rank, FSDP2-sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    for m in net.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return net


def _train(net, opt, steps) -> list[float]:
    """Steps of a loss over rank-dependent data, gradients clipped the way the sharded path clips (the norm over
    every shard): the norms before clipping."""
    from torch.distributed import get_rank

    from lathe.train.update import clipped_step
    norms = []
    for step in steps:
        g = torch.Generator().manual_seed(10 * step + get_rank())
        net(torch.randn(4, 6, generator=g)).square().mean().backward()
        norms.append(clipped_step(net, opt, grad_clip=0.5))
    return norms


def _full(net, opt) -> dict[str, torch.Tensor]:
    """Weights and moments as whole tensors, by name (every rank gathers)."""
    out = {}
    for name, p in net.named_parameters():
        out[name] = p.full_tensor().detach().clone()
        for k in MOMENTS:
            out[f"{name}.{k}"] = opt.state[p][k].full_tensor().clone()
    return out


def _by_name_round_trip(off_net, off, ref_net, ref) -> tuple[dict, dict]:
    """Each optimizer's full state by name (every rank gathers it), loaded into a fresh optimizer of the other kind:
    the state each ends with, as whole tensors (before, after)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True)
    into_off_net, into_ref_net = _sharded_net(), _sharded_net()
    into_off = OffloadedAdamW(into_off_net.parameters(), chunk_numel=CHUNK, **HPARAMS)
    into_ref = torch.optim.AdamW(into_ref_net.parameters(), **HPARAMS)
    set_optimizer_state_dict(into_off_net, into_off, get_optimizer_state_dict(ref_net, ref, options=full),
                             options=full)
    set_optimizer_state_dict(into_ref_net, into_ref, get_optimizer_state_dict(off_net, off, options=full),
                             options=full)
    moments = lambda net, opt: {f"{name}.{k}": opt.state[p][k].full_tensor()  # noqa: E731
                                for name, p in net.named_parameters() for k in MOMENTS}
    on_host = all(s[k].to_local().device.type == "cpu" for s in into_off.state.values() for k in MOMENTS)
    return ({"off": moments(off_net, off), "ref": moments(ref_net, ref)},
            {"off": moments(into_ref_net, into_ref), "ref": moments(into_off_net, into_off), "on_host": on_host})


def _rank_work(root: Path) -> dict:
    from torch.distributed import get_rank

    from lathe.train import parallel
    off_net, ref_net = _sharded_net(), _sharded_net()
    off = OffloadedAdamW(off_net.parameters(), chunk_numel=CHUNK, **HPARAMS)
    ref = torch.optim.AdamW(ref_net.parameters(), **HPARAMS)
    out = {"norms": (_train(off_net, off, range(3)), _train(ref_net, ref, range(3)))}
    out["trained"] = (_full(off_net, off), _full(ref_net, ref))
    locals_ = [off.state[p][k].to_local() for p in off_net.parameters() for k in MOMENTS]
    out["host_locals"] = all(t.device.type == "cpu" for t in locals_)
    # checkpoints (torch.distributed.checkpoint) across the two: offloaded -> resident and resident -> offloaded
    parallel.save_sharded(root / "off", off_net, off)
    parallel.save_sharded(root / "ref", ref_net, ref)
    to_ref_net, to_off_net = _sharded_net(), _sharded_net()
    to_ref = torch.optim.AdamW(to_ref_net.parameters(), **HPARAMS)
    to_off = OffloadedAdamW(to_off_net.parameters(), chunk_numel=CHUNK, **HPARAMS)
    parallel.load_sharded(root / "off", to_ref_net, to_ref)
    parallel.load_sharded(root / "ref", to_off_net, to_off)
    out["loaded"] = (_full(to_ref_net, to_ref), _full(to_off_net, to_off))
    # the full (by name) form a one-device checkpoint and a LoRA run's optim.pt hold: gathered, then loaded
    out["full_same"] = _by_name_round_trip(off_net, off, ref_net, ref)
    for net, opt in ((off_net, off), (ref_net, ref), (to_ref_net, to_ref), (to_off_net, to_off)):
        _train(net, opt, range(3, 5))
    out["continued"] = [_full(net, opt) for net, opt in ((off_net, off), (ref_net, ref), (to_ref_net, to_ref),
                                                         (to_off_net, to_off))]
    out["steps"] = sorted({float(s["step"]) for s in to_off.state.values()})
    return out if get_rank() == 0 else {}


def _rank_main(rank: int, port: int, root: str, queue) -> None:
    def work():
        torch.save(_rank_work(Path(root)), Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, 2, port, queue, work, 60)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("offloaded_adamw")
    return spawn_saving_ranks(_rank_main, 2, root, [__name__, "torch.distributed.checkpoint",
                                                    "torch.distributed.fsdp"], timeout_s=60)[0]


def test_sharded_step_equals_torch_adamw_on_the_same_shards(sharded):
    off_norms, ref_norms = sharded["norms"]
    assert_close_rel(off_norms, ref_norms, REL, "grad norms")
    assert max(off_norms) > 0.5, "the gradients were clipped (the test covers clipping)"
    off, ref = sharded["trained"]
    assert_close_rel(off, ref, REL, "weights and moments")
    assert sharded["host_locals"]


def test_sharded_checkpoints_resume_across_offloaded_and_resident(sharded):
    off, ref = sharded["trained"]
    to_ref, to_off = sharded["loaded"]
    assert_close_rel(to_ref, off, REL, "offloaded -> resident")
    assert_close_rel(to_off, ref, REL, "resident -> offloaded")
    off_c, ref_c, to_ref_c, to_off_c = sharded["continued"]
    assert_close_rel(to_ref_c, off_c, REL, "resident, resumed from offloaded, two more steps")
    assert_close_rel(to_off_c, ref_c, REL, "offloaded, resumed from resident, two more steps")
    assert sharded["steps"] == [5.0]


def test_full_state_by_name_loads_across_offloaded_and_resident(sharded):
    before, after = sharded["full_same"]
    assert after.pop("on_host")
    assert_close_rel(after["off"], before["off"], REL, "offloaded's full state -> resident")
    assert_close_rel(after["ref"], before["ref"], REL, "resident's full state -> offloaded")


# -- CUDA ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_offloaded_step_on_cuda_equals_adamw_with_pinned_host_moments():
    params, opt, ref_params, ref = _pair(4, "cuda")
    saved = opt.state_dict()                   # waits for the copies back to host memory
    _assert_same(opt, params, ref, ref_params)
    assert all(opt.state[p][k].device.type == "cpu" and opt.state[p][k].is_pinned() for p in params for k in MOMENTS)
    fresh = OffloadedAdamW(_params(device="cuda"), chunk_numel=CHUNK, **HPARAMS)
    fresh.load_state_dict(ref.state_dict())    # CUDA moments come back into pinned host memory
    assert all(s[k].device.type == "cpu" and s[k].is_pinned() for s in fresh.state.values() for k in MOMENTS)
    assert saved["state"][0]["step"].device.type == "cpu"


@pytest.mark.gpu
def test_pipelined_streaming_on_cuda_equals_one_chunk_and_fused_adamw_step_after_step():
    """Tensors of ~1M elements in chunks of 2^18 (a dozen chunks a step, each copy large enough to overlap the next
    chunk's): every step equals, bit for bit, the same optimizer streaming one chunk a step (no pipelining: the
    same kernel on the same numbers), and torch's fused AdamW to `REL`; the host is read only at the end, so the
    next step's copies in rely on the join of this step's write-backs. The device held two chunks at most."""
    from lathe.device import peak_memory, reset_peak_memory
    shapes = ((1024, 1024), (4099,), (3, 1000, 333), (2048, 511))
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    runs = {}
    for name, chunk in (("pipelined", 1 << 18), ("one_chunk", 1 << 30), ("fused", None)):
        params = [nn.Parameter(t.cuda()) for t in init]
        opt = (torch.optim.AdamW(params, fused=True, **HPARAMS) if chunk is None
               else OffloadedAdamW(params, chunk_numel=chunk, **HPARAMS))
        for step in range(5):
            gg = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gg).cuda()
            torch.cuda.synchronize()
            reset_peak_memory("cuda")
            before = torch.cuda.memory_allocated()
            opt.step()
            peak = peak_memory("cuda")[0] - before
            if name == "pipelined":
                assert peak <= 2 * 3 * 4 * (1 << 18) + (1 << 20), f"step {step}: {peak} bytes over the step"
                assert opt.last_stream.chunks > 8 and opt.last_stream.seconds() > 0
            opt.zero_grad()
        opt.state_dict()                           # waits for the write-backs
        runs[name] = ([p.detach().clone() for p in params],
                      [opt.state[p][k].to("cuda") for p in params for k in MOMENTS])
    for a, b in zip(runs["pipelined"], runs["one_chunk"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "the pipeline changed the numbers"
    for a, b in zip(runs["pipelined"], runs["fused"]):
        assert_close_rel(torch.cat([x.flatten() for x in a]), torch.cat([y.flatten() for y in b]), REL, "vs fused")


@pytest.mark.gpu
def test_offloaded_fsdp2_shards_on_cuda_save_and_load_with_dcp(tmp_path):
    """One NCCL rank: the moments are DTensors on the CUDA mesh with pinned host locals; DCP round-trips them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lathe.train import parallel
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        nets = []
        for _ in range(2):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5)).cuda()
            fully_shard(net, mesh=init_device_mesh("cuda", (1,)))
            nets.append(net)
        off = OffloadedAdamW(nets[0].parameters(), chunk_numel=CHUNK, **HPARAMS)
        ref = torch.optim.AdamW(nets[1].parameters(), **HPARAMS)
        for net, opt in zip(nets, (off, ref)):
            for step in range(3):
                torch.manual_seed(step)
                net(torch.randn(4, 6, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert_close_rel(torch.cat([p.full_tensor().flatten() for p in nets[0].parameters()]),
                         torch.cat([p.full_tensor().flatten() for p in nets[1].parameters()]), REL, "params")
        local = next(iter(off.state.values()))["exp_avg"]
        assert local.device_mesh.device_type == "cuda" and local.to_local().is_pinned()
        parallel.save_sharded(tmp_path / "off", nets[0], off)
        parallel.load_sharded(tmp_path / "off", nets[1], ref)      # offloaded -> resident
        whole = lambda opt: torch.cat([s["exp_avg"].to("cuda").full_tensor().flatten()  # noqa: E731
                                       for s in opt.state.values()])    # NCCL gathers device tensors only
        assert_close_rel(whole(ref), whole(off), REL, "exp_avg")
        parallel.load_sharded(tmp_path / "off", nets[0], off)      # into itself: stays pinned host memory
        assert all(s[k].to_local().is_pinned() for s in off.state.values() for k in MOMENTS)
    finally:
        dist.destroy_process_group()


# -- the actor on 2 gloo ranks: the sharded path builds OffloadedAdamW; its checkpoints resume both ways -------------
def actor_job(world: int, offloaded: bool, **job) -> dict:
    """`test_parallel.train` on this rank with `optimizer_offload` acting as on CUDA when `offloaded` (offload_flags
    ignores it on a CPU); the optimizer classes the actor built join the result."""
    from unittest import mock

    import lathe.workers.actor as actor_module

    from .test_parallel import train
    built = []

    def flags(fsdp_cfg, device, *, key, frozen=False, sharded=False):
        return {"offload_params": False, "offload_state": offloaded}

    def build(*args, **kwargs):
        opt = build_optimizer(*args, **kwargs)
        built.append(type(opt).__name__)
        return opt
    with mock.patch.object(actor_module, "offload_flags", flags), \
            mock.patch.object(actor_module, "build_optimizer", build):
        return {**train(world, -1, **job), "built": built}


@pytest.fixture(scope="module")
def actor_runs(tmp_path_factory):
    """Resident and offloaded: 3 updates each (saving after 2), then the last update resumed from the other's
    checkpoint."""
    from .test_parallel import SAVED_AFTER, STEPS, run_ranks
    root = tmp_path_factory.mktemp("actor_offload")
    last = range(SAVED_AFTER, STEPS)
    return run_ranks(2, root / "ranks", dict(offloaded=False, save=root / "resident"),
                     dict(offloaded=True, save=root / "offloaded"),
                     dict(offloaded=True, steps=last, resume=root / "resident"),
                     dict(offloaded=False, steps=last, resume=root / "offloaded"), fn=actor_job)


def test_the_sharded_actor_updates_with_offloaded_moments_as_with_resident_ones(actor_runs):
    from .test_parallel import SAVED_AFTER, assert_same_run
    resident, offloaded, off_resumed, res_resumed = (run[0] for run in actor_runs)
    assert resident["built"] == ["AdamW"] and offloaded["built"] == ["OffloadedAdamW"]
    assert_same_run(offloaded, resident, rel=REL)
    tail = lambda run: {"metrics": run["metrics"][SAVED_AFTER:], "weights": run["weights"]}  # noqa: E731
    assert_same_run(off_resumed, tail(resident), rel=REL)      # offloaded, from the resident run's checkpoint
    assert_same_run(res_resumed, tail(offloaded), rel=REL)     # resident, from the offloaded run's checkpoint
