"""Tests for lathe.train.master.MasterAdamW: fp32 master weights behind a bf16 module.

The reference for every step is torch's own `torch.optim.AdamW` on fp32 tensors fed the same gradients; CPU
tests force the bf16 policy (the class does not care which device), offloading runs on a GPU; the streaming of
offloaded tensors (chunks, pieces of tensors cut across them) runs on the CPU too (`_streaming_on_cpu`).
"""

import copy
import math
from unittest.mock import patch

import pytest
import torch
from torch import nn

import lathe.train.master as master
from lathe.train.master import MOMENTS, MasterAdamW, host_like, host_moments, numel_chunks
from lathe.train.optim import build_optimizer
from lathe.train.precision import FP32, PrecisionPolicy
from lathe.train.update import clipped_step, load_trainable, save_trainable

MIXED = PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, master_dtype=torch.float32)
HPARAMS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _net(seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50)).to(device)


def _loss(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return net(tokens).float().logsumexp(-1).mean()


def _transposed(net: nn.Module) -> nn.Module:
    """`net` with its head's weight stored transposed: (50, 32), strides (1, 50)."""
    net[3].weight = nn.Parameter(net[3].weight.detach().t().contiguous().t())
    return net


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (4, 7), generator=g) for _ in range(n)]


def test_construction_casts_the_module_and_keeps_the_original_weights_as_masters():
    net = _net()
    originals = [p.detach().clone() for p in net.parameters()]
    storages = [p.data_ptr() for p in net.parameters()]
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    masters = opt.param_groups[0]["params"]
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    assert [m.data_ptr() for m in masters] == storages, "the loaded fp32 tensors become the masters (no copy)"
    assert all(torch.equal(m, o) for m, o in zip(masters, originals))


def test_micro_batch_gradients_accumulate_in_fp32_and_bf16_gradients_are_freed():
    net, twin = _net(), _net()
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    twin.to(torch.bfloat16)
    expected = [torch.zeros(p.shape) for p in twin.parameters()]
    for tokens in _batches(3):
        _loss(net, tokens).backward()
        assert all(p.grad is None for p in net.parameters()), "each bf16 gradient is freed once accumulated"
        twin.zero_grad()
        _loss(twin, tokens).backward()
        for e, p in zip(expected, twin.parameters()):
            e += p.grad.float()
    assert all(g.dtype == torch.float32 for g in opt.grads)
    assert max(_rel(g, e) for g, e in zip(opt.grads, expected)) < 1e-6


def test_step_equals_torch_adamw_on_the_masters_and_casts_them_into_the_module():
    net = _net()
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    reference = [m.detach().clone().requires_grad_(True) for m in opt.param_groups[0]["params"]]
    torch_opt = torch.optim.AdamW(reference, foreach=False, **HPARAMS)
    for tokens in _batches(4):
        opt.zero_grad()
        _loss(net, tokens).backward()
        for r, g in zip(reference, opt.grads):
            r.grad = g.clone()
        opt.step()
        torch_opt.step()
        masters = opt.param_groups[0]["params"]
        assert max(_rel(m, r) for m, r in zip(masters, reference)) < 1e-6
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(net.parameters(), masters))


def test_clip_grad_norm_equals_torchs_on_the_same_gradients():
    net = _net()
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    _loss(net, _batches(1)[0]).backward()
    twins = [torch.zeros_like(g, requires_grad=True) for g in opt.grads]
    for t, g in zip(twins, opt.grads):
        t.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.01)
    norm = opt.clip_grad_norm_(0.01)
    assert _rel(norm, expected) < 1e-6 and float(norm) > 0.01, "precondition: the norm is above the clip"
    assert max(_rel(g, t.grad) for g, t in zip(opt.grads, twins)) < 1e-6


def test_clipped_step_skips_a_non_finite_gradient_and_frees_it():
    net = _net()
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    before = [p.detach().clone() for p in net.parameters()]
    (_loss(net, _batches(1)[0]) * float("inf")).backward()
    assert not math.isfinite(clipped_step(net, opt, 1.0))
    assert all(g is None for g in opt.grads)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_tied_weights_get_one_master():
    net = _net()
    head = nn.Linear(16, 50, bias=False)
    head.weight = net[0].weight                      # tied: the same Parameter twice in the module
    model = nn.ModuleDict({"body": net, "head": head})
    opt = MasterAdamW(model.parameters(), policy=MIXED, **HPARAMS)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    state = opt.master_state_dict(model)
    assert state["head.weight"].data_ptr() == state["body.0.weight"].data_ptr()
    assert state["head.weight"].dtype == torch.float32


def test_state_dict_interchanges_with_torch_adamw_and_resume_is_exact():
    net = _net()
    opt = MasterAdamW(net.parameters(), policy=MIXED, **HPARAMS)
    batches = _batches(4)
    for tokens in batches[:2]:
        opt.zero_grad()
        _loss(net, tokens).backward()
        opt.step()
    saved, masters = copy.deepcopy(opt.state_dict()), {k: v.clone() for k, v in opt.master_state_dict(net).items()}
    # continue: two more steps
    for tokens in batches[2:]:
        opt.zero_grad()
        _loss(net, tokens).backward()
        opt.step()
    # resume into a fresh module from the saved masters and state
    fresh = _net(seed=5)
    opt2 = MasterAdamW(fresh.parameters(), policy=MIXED, **HPARAMS)
    opt2.load_master_state_dict(fresh, masters)
    opt2.load_state_dict(saved)
    for tokens in batches[2:]:
        opt2.zero_grad()
        _loss(fresh, tokens).backward()
        opt2.step()
    for a, b in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert torch.equal(a, b)
    # the same state drives torch's AdamW on fp32 copies of the masters
    plain = [m.clone().requires_grad_(True) for m in masters.values()]
    torch_opt = torch.optim.AdamW(plain, foreach=False, **HPARAMS)
    torch_opt.load_state_dict(saved)
    assert torch_opt.state[plain[0]]["exp_avg"].shape == plain[0].shape


def test_build_optimizer_picks_master_adamw_only_for_mixed_precision_or_offload():
    assert type(build_optimizer(_net().parameters(), _optim_cfg())) is torch.optim.AdamW
    assert isinstance(build_optimizer(_net().parameters(), _optim_cfg(), policy=MIXED), MasterAdamW)
    with pytest.raises(ValueError, match="CUDA"):
        build_optimizer(_net().parameters(), _optim_cfg(), policy=FP32, offload_state=True)


def test_save_and_load_trainable_keep_the_fp32_masters(tmp_path, make_lathe):
    model = make_lathe(0)
    opt = MasterAdamW(model.parameters(), policy=MIXED, **HPARAMS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(2, 40, (3, 9))
    model(ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    save_trainable(tmp_path, model, opt, sched)
    fresh = make_lathe(3)
    opt2 = MasterAdamW(fresh.parameters(), policy=MIXED, **HPARAMS)
    load_trainable(tmp_path, fresh, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0), what="actor",
                   ignore_missing=lambda n: n == "lm_head.weight")
    for a, b in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert torch.equal(a, b), "the masters come back bit for bit, not through bf16"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


class _WholeTensors(MasterAdamW):
    """MasterAdamW as it chunked before tensors were cut: whole tensors, one larger than `chunk_numel` a chunk of its
    own (the reference for the cut pieces' numbers)."""

    def _chunks(self, masters):
        if not (self.offload_params or self.offload_state):
            return super()._chunks(masters)
        return [[(masters[i], 0, masters[i].numel()) for i, _, _ in chunk]
                for chunk in numel_chunks([m.numel() for m in masters], self.chunk_numel)]


def _streaming_on_cpu(cls, net: nn.Module, offload_params: bool, offload_state: bool, chunk_numel: int):
    """`cls` over `net` streaming as with offload, on the CPU: the constructor refuses offload off CUDA, the streaming
    itself runs anywhere (`StreamedAdam` copies a streamed tensor already on the device all the same)."""
    opt = cls(net.parameters(), policy=MIXED, chunk_numel=chunk_numel, **HPARAMS)
    opt.offload_params, opt.offload_state = offload_params, offload_state
    opt._host = host_moments(opt._masters(), pin=False)       # (the moments' host memory, as with offload)
    return opt


@pytest.mark.parametrize("offload_params,offload_state", [(False, True), (True, True), (True, False)])
def test_tensors_larger_than_a_chunk_are_cut_across_chunks_bit_for_bit(offload_params, offload_state):
    """The embedding (800 elements) and the head (1600) against chunks of 300: cut into pieces across chunks (every
    chunk at most 300 elements, pieces starting anywhere in a tensor), the numbers are those of whole-tensor chunks
    and of the resident step, bit for bit, over four steps: masters, moments, step counts (advanced once a step
    however many pieces), module parameters; the state dict keeps one step and two moments per master."""
    nets = [_net() for _ in range(3)]
    cut = _streaming_on_cpu(MasterAdamW, nets[0], offload_params, offload_state, 300)
    whole = _streaming_on_cpu(_WholeTensors, nets[1], offload_params, offload_state, 300)
    resident = MasterAdamW(nets[2].parameters(), policy=MIXED, **HPARAMS)
    opts = (cut, whole, resident)
    for tokens in _batches(4):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            _loss(net, tokens).backward()
            opt.step()
    masters = cut.param_groups[0]["params"]
    chunks = cut._chunks(masters)
    assert max(sum(stop - start for _, start, stop in chunk) for chunk in chunks) <= 300
    assert sum(len(chunk) for chunk in chunks) > len(masters), "tensors are cut into pieces"
    assert cut.last_stream.chunks == -(-sum(m.numel() for m in masters) // 300), "every chunk but the last is full"
    for opt in opts[1:]:
        assert all(torch.equal(a, b) for a, b in zip(cut.param_groups[0]["params"], opt.param_groups[0]["params"]))
        sa, sb = cut.state_dict(), opt.state_dict()
        assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
        for i, state in sa["state"].items():
            assert state.keys() == sb["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(state[k], sb["state"][i][k]) for k in state), i
            assert float(state["step"]) == 4.0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*(n.parameters() for n in nets)))


def test_a_non_contiguous_parameter_is_streamed_whole():
    """A weight stored transposed (non-contiguous: its gradient too) cannot be viewed flat: it goes whole, a chunk of
    its own, while the contiguous tensors around it are cut; the numbers are the resident step's."""
    streamed, plain = _transposed(_net()), _transposed(_net())
    assert not streamed[3].weight.is_contiguous()
    opt = _streaming_on_cpu(MasterAdamW, streamed, True, True, 300)
    resident = MasterAdamW(plain.parameters(), policy=MIXED, **HPARAMS)
    layouts = []

    def adam(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):
        layouts.extend({t.stride() for t in ts} for ts in zip(params, grads, exp_avgs, exp_avg_sqs))
        return real_adam(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)
    real_adam = master.adam
    for tokens in _batches(3):
        for model, o in ((streamed, opt), (plain, resident)):
            o.zero_grad()
            _loss(model, tokens).backward()
            with patch.object(master, "adam", adam):
                o.step()
    # CUDA's fused kernel requires a master, its gradient and moments laid out alike: the streamed copies keep the
    # transposed weight's strides
    assert (50, 32) in {(m.shape[0], m.shape[1]) for m in opt._masters() if m.dim() == 2}
    assert layouts and all(len(strides) == 1 for strides in layouts), layouts
    assert {(1, 50)} in layouts
    chunks = opt._chunks(opt.param_groups[0]["params"])
    head = opt.param_groups[0]["params"][3]
    assert [(start, stop) for chunk in chunks for m, start, stop in chunk if m is head] == [(0, 1600)]
    assert [(start, stop) for chunk in chunks for m, start, stop in chunk if m is opt.param_groups[0]["params"][0]
            ] == [(0, 300), (300, 600), (600, 800)]
    assert all(torch.equal(a, b) for a, b in zip(streamed.parameters(), plain.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], resident.param_groups[0]["params"]))

def test_host_memory_is_laid_out_like_each_tensor_in_shared_buffers():
    """`host_like`: one host tensor per tensor, its shape, its strides where it is stored transposed (CUDA's fused
    AdamW needs a master's moments laid out as the master), in the dtype asked; the small ones share a buffer."""
    tensors = [torch.zeros(6, 4).t(), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, 5), torch.zeros(4)[::2]]
    hosts = host_like(tensors, pin=False, dtype=torch.float32)
    assert [h.shape for h in hosts] == [t.shape for t in tensors] and {h.dtype for h in hosts} == {torch.float32}
    assert hosts[0].stride() == (1, 4) and hosts[2].is_contiguous() and hosts[3].is_contiguous()   # (not dense: plain)
    assert len({h.untyped_storage().data_ptr() for h in hosts}) == 1


def test_a_loaded_state_goes_straight_into_the_host_memory_the_moments_live_in():
    """With the moments in host memory, `load_state_dict` copies each saved moment into it (torch's would first put
    them all on the masters' device: twice the fp32 model on the GPU with `offload_state` alone); the resumed steps
    are the uninterrupted ones."""
    nets = [_net(), _net()]
    opts = [_streaming_on_cpu(MasterAdamW, net, False, True, 300) for net in nets]
    batches = _batches(3)
    for tokens in batches[:2]:
        opts[0].zero_grad()
        _loss(nets[0], tokens).backward()
        opts[0].step()
    opts[1].load_master_state_dict(nets[1], opts[0].master_state_dict(nets[0]))
    places = [t.data_ptr() for k in MOMENTS for t in opts[1]._host[k]]
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    masters = opts[1]._masters()
    assert [opts[1].state[m][k].data_ptr() for k in MOMENTS for m in masters] == places
    assert all(opts[1].state[m]["step"].dtype == torch.float32 for m in masters)
    for net, opt in zip(nets, opts):
        opt.zero_grad()
        _loss(net, batches[2]).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(*(o._masters() for o in opts)))
    wrong = copy.deepcopy(opts[0].state_dict())
    wrong["state"][0]["exp_avg"] = wrong["state"][0]["exp_avg"][:1]          # would broadcast into its place
    with pytest.raises(ValueError, match="exp_avg has shape"):
        opts[1].load_state_dict(wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("offload_params,offload_state", [(False, True), (True, True), (True, False)])
def test_offloaded_step_streams_through_the_gpu_and_equals_the_resident_one(offload_params, offload_state,
                                                                            transposed):
    """(True, False): param_offload alone keeps the moments by the host masters too, and the step must write them
    back (the streaming's first shared form did not). Transposed: a weight stored transposed streams with its
    strides (the fused kernel refuses a master, gradient and moments laid out differently)."""
    resident, offloaded = (_transposed(n) if transposed else n for n in (_net(device="cuda"), _net(device="cuda")))
    a = MasterAdamW(resident.parameters(), policy=MIXED, **HPARAMS)
    b = MasterAdamW(offloaded.parameters(), policy=MIXED, offload_params=offload_params, offload_state=offload_state,
                    chunk_numel=700, **HPARAMS)
    assert all(m.device.type == ("cpu" if offload_params else "cuda") for m in b.param_groups[0]["params"])
    for tokens in _batches(3):
        for net, opt in ((resident, a), (offloaded, b)):
            opt.zero_grad()
            _loss(net, tokens.cuda()).backward()
            opt.step()
    assert b.state[b.param_groups[0]["params"][0]]["exp_avg"].device.type == "cpu"
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.master_state_dict(resident).values(),
                                                              b.master_state_dict(offloaded).values()))
    assert all(torch.equal(x, y) for x, y in zip(resident.parameters(), offloaded.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("offload_params,offload_state", [(False, True), (True, True), (True, False)])
def test_pipelined_offload_over_many_chunks_equals_the_resident_step_after_step(offload_params, offload_state):
    """Ten layers in chunks of 2^16 elements (the embedding and the head, 2^17 each, cut across two chunks; some
    thirteen full chunks a step, each copy large enough to overlap the next chunk's): after every step the module's
    parameters equal the resident optimizer's bit for bit, read on the device without waiting for the host (the next
    step's copies in rely on this step's write-backs being joined into the compute stream); at the end the masters
    and moments too."""
    def net(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        layers = [nn.Embedding(512, 256)] + [m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())]
        return nn.Sequential(*layers, nn.Linear(256, 512)).cuda()

    resident, offloaded = net(), net()
    a = MasterAdamW(resident.parameters(), policy=MIXED, **HPARAMS)
    b = MasterAdamW(offloaded.parameters(), policy=MIXED, offload_params=offload_params, offload_state=offload_state,
                    chunk_numel=1 << 16, **HPARAMS)
    for step, tokens in enumerate(_batches(6)):
        for model, opt in ((resident, a), (offloaded, b)):
            opt.zero_grad()
            _loss(model, tokens.cuda()).backward()
            opt.step()
        assert b.last_stream.chunks == -(-sum(p.numel() for p in offloaded.parameters()) // (1 << 16)) == 13
        assert all(torch.equal(x, y) for x, y in zip(resident.parameters(), offloaded.parameters())), f"step {step}"
    assert b.last_stream.seconds() > 0
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.master_state_dict(resident).values(),
                                                              b.master_state_dict(offloaded).values()))
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert all(torch.equal(sa[i][k].cpu(), sb[i][k].cpu()) for i in sa for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.gpu
def test_streamed_buffers_stay_two_chunks_whatever_the_largest_tensor_as_the_memory_plan_counts(monkeypatch):
    """An embedding and an untied head larger than `chunk_numel` (2^18 elements against 2^16) are cut across chunks:
    the device memory the step adds is two chunks' buffers (masters and moments, 12 bytes an element), what the
    memory plan (`streamed_step_parts`) counts, not the two largest tensors' (whole tensors took 2 x 2^18 x 12)."""
    from lathe.config import load_config
    from lathe.device import peak_memory, reset_peak_memory
    from lathe.train import master, memory
    chunk = 1 << 16
    monkeypatch.setattr(master, "CHUNK_NUMEL", chunk)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1024, 256), nn.Linear(256, 256), nn.Linear(256, 1024, bias=False)).cuda()
    opt = MasterAdamW(model.parameters(), policy=MIXED, offload_params=True, offload_state=True, chunk_numel=chunk,
                      **HPARAMS)
    _loss(model, _batches(1)[0].cuda()).backward()
    torch.cuda.synchronize()
    reset_peak_memory("cuda")
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    added = peak_memory("cuda")[0] - before
    n = sum(p.numel() for p in model.parameters())
    assert opt.last_stream.chunks == -(-n // chunk) == 10, "the step ran in full chunks of 2^16 elements"
    fsdp = load_config("base", ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
                       ).actor_rollout_ref.actor.fsdp_config
    planned = memory.streamed_step_parts("actor", "actor_rollout_ref.actor", n, fsdp, torch.device("cuda"),
                                         sharded=False)[0].nbytes
    assert planned == 2 * chunk * 12
    # (the slack: each view in a buffer starts at a 256-byte boundary, and the step counters, 512 bytes each)
    assert chunk * 12 < added <= planned + (1 << 16) < 2 * (1 << 18) * 12, (added, planned)


@pytest.mark.gpu
@pytest.mark.parametrize("offload_params,offload_state", [(False, True), (True, True), (True, False)])
def test_offloaded_moments_are_pinned_host_memory_fresh_and_resumed(offload_params, offload_state):
    """With either switch the moments live in pinned host memory (param_offload alone: by the host masters), and a
    loaded checkpoint puts them there again. Before, param_offload alone made pageable moments (a torch.device was
    compared with the string "cpu") and a resume moved them to the GPU."""
    def moments(opt):
        return [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]

    nets = [_net(device="cuda") for _ in range(2)]
    opts = [MasterAdamW(net.parameters(), policy=MIXED, offload_params=offload_params, offload_state=offload_state,
                        chunk_numel=700, **HPARAMS) for net in nets]
    opts[0].zero_grad()
    _loss(nets[0], _batches(1)[0].cuda()).backward()
    opts[0].step()
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    for opt in opts:
        assert moments(opt) and all(t.device.type == "cpu" and t.is_pinned() for t in moments(opt))


# -- StreamedAdam: the pipeline on fake streams (CPU) -------------------------------------------------------------
GROUP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _streamed_tensors(sizes: list[tuple[int, ...]], seed: int = 0):
    """Params, moments (`states`) and step counters of `sizes` elements, and 2 steps' gradients."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for chunk in sizes for n in chunk]
    states = [{"exp_avg": torch.randn(p.shape, generator=g), "exp_avg_sq": torch.rand(p.shape, generator=g)}
              for p in params]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
    return params, states, [torch.zeros(()) for _ in params], grads


@pytest.mark.parametrize("sizes", [[(8, 12)] * 5, [(3,), (40, 2), (5,), (7, 60), (1, 1), (90,)]],
                         ids=["even", "growing"])
def test_streamed_adam_overlaps_the_copies_races_nothing_and_holds_two_chunks(stream_log, sizes):
    """Two steps of chunks (params and moments streamed, the caller reading the updated params on the compute stream
    as MasterAdamW does), on fake streams: every pair of operations touching the same bytes on different streams is
    ordered on the device (the slots reused two chunks later, the host tensors across steps); the device holds two
    buffers; with even chunks, a chunk's copies in overlap the previous chunk's kernel and write-back. The numbers
    are those of torch's kernel run on the tensors directly, bit for bit."""
    from torch.optim.adam import adam

    from lathe.train.master import StreamedAdam
    params, states, steps, grads = _streamed_tensors(sizes)
    ref = copy.deepcopy((params, states, steps))
    bounds = [0]
    for i in range(len(sizes)):
        bounds.append(bounds[-1] + len(sizes[i]))
    chunks = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    marks, streams, largest = [], [], 0
    for step in range(2):
        stream = StreamedAdam(torch.device("cpu"))
        for chunk in chunks:
            start = len(stream_log.log)
            out = stream.update(GROUP, [params[i] for i in chunk], [grads[step][i] for i in chunk],
                                [states[i] for i in chunk], [steps[i] for i in chunk], stream_params=True,
                                stream_moments=True)
            marks.append(stream_log.log[start:])
            largest = max(largest, 3 * sum(-(-4 * params[i].numel() // 256) * 256 for i in chunk))
            held = [s.buffer.numel() for s in stream.slots if s.buffer is not None]
            assert sum(held) <= 2 * largest, "the device holds two chunks' streamed tensors at most"
            stream_log.access(out, [], "cast")             # MasterAdamW's cast into the module
        stream.finish()
        streams.append(stream)
        assert isinstance(stream.seconds(), float)
        rp, rs, rsteps = ref
        for chunk in chunks:
            adam([rp[i] for i in chunk], [grads[step][i] for i in chunk], [rs[i]["exp_avg"] for i in chunk],
                 [rs[i]["exp_avg_sq"] for i in chunk], [], [rsteps[i] for i in chunk], foreach=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=GROUP["lr"],
                 weight_decay=GROUP["weight_decay"], eps=GROUP["eps"], maximize=False)
    assert not stream_log.races(), [(a["stream"], a["what"], b["stream"], b["what"]) for a, b in stream_log.races()]
    assert all(torch.equal(a, b) for a, b in zip(params, ref[0]))
    assert all(torch.equal(s[k], r[k]) for s, r in zip(states, ref[1]) for k in ("exp_avg", "exp_avg_sq"))
    for step, stream in enumerate(streams):
        ops = marks[step * len(chunks):(step + 1) * len(chunks)]
        h2d = [[e for e in chunk if e["stream"] == stream.h2d] for chunk in ops]
        d2h = [[e for e in chunk if e["stream"] == stream.d2h] for chunk in ops]
        kernel = [next(e for e in chunk if e["what"] == "adam") for chunk in ops]
        assert all(h and d and k["stream"] == "compute" for h, d, k in zip(h2d, d2h, kernel))
        assert stream_log.double_buffered(stream.h2d)
        if sizes[0] != sizes[-1]:
            continue
        slots = {t.untyped_storage().data_ptr() for chunk in h2d for e in chunk for t, w in e["tensors"] if w}
        assert len(slots) == 2, "two device buffers, taken in turn"
        before = stream_log.before
        for c in range(1, len(chunks) - 1):
            nxt = h2d[c + 1]
            assert before(d2h[c - 1][-1], nxt[0]), "a buffer is written again once written back"
            assert not before(kernel[c], nxt[0]) and not before(d2h[c][0], nxt[0]) and not before(nxt[-1], d2h[c][0])



def test_master_adamw_cuts_a_big_tensor_and_holds_two_chunks_buffers_on_fake_streams(stream_log, monkeypatch):
    """MasterAdamW streaming its masters and moments on fake streams, chunks of 300 elements against a head of 1600
    and an embedding of 800: the big tensors go through in pieces, the device buffers live at any time (taken and
    freed on the compute stream, as the allocator sees them) are two chunks' at most, where whole tensors needed the
    head's and the embedding's; nothing races (the cast into the module read on the compute stream); the numbers
    are the resident step's."""
    from lathe.train import master

    class Logged(master.StreamedAdam):
        def update(self, *args, **kwargs):
            out = super().update(*args, **kwargs)
            stream_log.access(out, [], "cast")          # MasterAdamW's cast into the module, on the compute stream
            return out
    monkeypatch.setattr(master, "StreamedAdam", Logged)

    def peak_live(log) -> int:
        live, peak = {}, 0
        for entry in log:
            for t, _ in entry["tensors"] if entry["what"] in ("alloc", "free") else []:
                if entry["what"] == "alloc":
                    live[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
                else:
                    live.pop(t.untyped_storage().data_ptr(), None)
            peak = max(peak, sum(live.values()))
        return peak

    nets = [_net(), _net(), _net()]
    cut = _streaming_on_cpu(MasterAdamW, nets[0], True, True, 300)
    whole = _streaming_on_cpu(_WholeTensors, nets[1], True, True, 300)
    resident = MasterAdamW(nets[2].parameters(), policy=MIXED, **HPARAMS)
    peaks = []
    for opt, net in zip((cut, whole), nets):
        start = len(stream_log.log)
        for tokens in _batches(2):
            opt.zero_grad()
            _loss(net, tokens).backward()
            opt.step()
        peaks.append(peak_live(stream_log.log[start:]))
    for tokens in _batches(2):
        resident.zero_grad()
        _loss(nets[2], tokens).backward()
        resident.step()
    assert cut.last_stream.chunks == 10 and whole.last_stream.chunks == 5
    pieces = max(len(chunk) for chunk in cut._chunks(cut.param_groups[0]["params"]))
    one_chunk = 3 * (4 * 300 + 256 * pieces)      # master and moments, each piece's view at a 256-byte boundary
    assert peaks[0] <= 2 * one_chunk < 3 * 4 * (1600 + 800) <= peaks[1], peaks
    assert not stream_log.races(), [(a["stream"], a["what"], b["stream"], b["what"]) for a, b in stream_log.races()]
    assert stream_log.double_buffered(cut.last_stream.h2d)
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[2].parameters()))
    assert all(torch.equal(a, b) for a, b in zip(cut.param_groups[0]["params"], resident.param_groups[0]["params"]))

def _optim_cfg():
    from lathe.config import load_config
    return load_config(None).actor_rollout_ref.actor.optim
