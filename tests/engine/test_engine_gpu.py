"""The engine's CUDA path (Triton decode kernel, CUDA graphs, flash prefill) against transformers on the GPU."""

import pytest
import torch

from lathe import device as accel
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.paged_attention import decode_attention
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel

from .conftest import PROMPTS
from .test_llm_engine import _teacher_forced

pytestmark = pytest.mark.gpu
MAX = 12


def test_triton_kernel_on_cuda_bf16():
    from lathe.engine.triton_decode import paged_decode
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, hq, hkv, dim, splits in ((64, 14, 2, 64, 1), (3, 28, 4, 128, 8), (5, 12, 2, 128, 3)):
        kc, vc = (torch.randn(300, 16, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        lens = torch.randint(1, 700, (batch,), device="cuda", generator=g).int()
        tables = torch.randint(0, 300, (batch, 44), device="cuda", generator=g).int()
        q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        out = paged_decode(q, kc, vc, tables, lens, num_splits=splits)
        ref = decode_attention(q.float(), kc.float(), vc.float(), tables.long(), lens.long())
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_split_merge_in_a_cuda_graph_shares_counters_across_layers_and_replays():
    """Three split launches (three layers) captured in one graph with one counter set, replayed with new inputs:
    every output equals the reference (norm-relative, bf16) and the counters are zero after each replay."""
    from lathe.engine.triton_decode import paged_decode
    g = torch.Generator(device="cuda").manual_seed(1)
    batch, hq, hkv, dim, splits = 24, 12, 2, 128, 6
    kcs = [torch.randn(400, 16, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    vcs = [torch.randn_like(k) for k in kcs]
    tables = torch.randint(0, 400, (batch, 64), device="cuda", generator=g).int()
    lens = torch.randint(1, 1000, (batch,), device="cuda", generator=g).int()
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")

    def step():
        return [paged_decode(q, kc, vc, tables, lens, num_splits=splits, counters=counters) for kc, vc in zip(kcs, vcs)]
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        q.copy_(torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g))
        lens.copy_(torch.randint(1, 1000, (batch,), device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert counters.eq(0).all()
        for out, kc, vc in zip(outs, kcs, vcs):
            ref = decode_attention(q.float(), kc.float(), vc.float(), tables.long(), lens.long())
            assert_close_rel(out.float(), ref, rel=2e-2, name="graph-replayed split decode")


def test_programmatic_dependent_launch_after_a_projection_equals_plain_launch():
    """`pdl=True` in a CUDA graph where each launch follows the projection that writes its q, k and v (the decode
    step's order): outputs and caches equal plain launches bit for bit over replays with new inputs. It shows the
    dependent launch captures, replays and computes the same; it cannot show the wait is never needed (a race without
    it would be rare: the programs launch once the projection's programs have exited)."""
    from lathe.engine.triton_decode import paged_decode, pdl_available
    if not pdl_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and a Triton with gdc_wait")
    g = torch.Generator(device="cuda").manual_seed(2)
    batch, hq, hkv, dim, page, layers, hidden = 64, 12, 2, 128, 16, 3, 4096
    width = (hq + 2 * hkv) * dim
    ws = [torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * hidden ** -0.5
          for _ in range(layers)]
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.randint(1, 500, (batch,), device="cuda", generator=g).int()
    per = 32
    tables = torch.randperm(batch * per, device="cuda", generator=g).view(batch, per).int()
    pos = lens.long() - 1
    slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    angles = torch.randn(batch, dim // 2, device="cuda", generator=g)
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16()
    caches = {pdl: [[torch.randn(batch * per, page, hkv, dim, device="cuda", dtype=torch.bfloat16,
                                 generator=torch.Generator(device="cuda").manual_seed(10 * i + j))
                     for j in range(2)] for i in range(layers)] for pdl in (False, True)}

    def step(pdl):
        outs = []
        for w, (kc, vc) in zip(ws, caches[pdl]):
            q, k, v = torch.nn.functional.linear(x, w).split([hq * dim, hkv * dim, hkv * dim], dim=-1)
            outs.append(paged_decode(q.view(batch, hq, dim), kc, vc, tables, lens,
                                     new_kv=(k.view(batch, hkv, dim), v.view(batch, hkv, dim), cos, sin, slots),
                                     pdl=pdl))
        return outs

    graphs, outs = {}, {}
    for pdl in (False, True):
        step(pdl)
        torch.cuda.synchronize()
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            outs[pdl] = step(pdl)
    for _ in range(3):
        x.copy_(torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16, generator=g))
        for pdl in (False, True):
            graphs[pdl].replay()
        torch.cuda.synchronize()
        for a, b in zip(outs[False], outs[True]):
            assert torch.equal(a, b)
        for (ka, va), (kb, vb) in zip(caches[False], caches[True]):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_engine_greedy_equals_transformers(checkpoints, family):
    """fp32 on the GPU: graphs + Triton decode + prefix sharing give transformers' greedy tokens."""
    path, hf = checkpoints[family]
    hf = hf.to("cuda")
    engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4, num_kv_blocks=128,
                                         decode_backend="triton")
    assert engine.runner.graphs is not None
    assert engine.runner.graphs.pdl == (torch.cuda.get_device_capability()[0] >= 9)   # the kernel after q/k/v
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_tokens=MAX))
    for i, prompt in enumerate(PROMPTS):
        ids = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=MAX,
                          min_new_tokens=MAX, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids[3 * i:3 * i + 3] == [ids] * 3
    hf.to("cpu")


def fixed_address_off(monkeypatch):
    """The KV cache in PyTorch's allocator for this test (LATHE_KV_FIXED_ADDRESS=0: the path where the driver lacks
    fixed-address memory)."""
    from lathe.engine import vmm
    monkeypatch.setenv("LATHE_KV_FIXED_ADDRESS", "0")
    vmm.supported.cache_clear()         # (and after each test: `_fixed_address_answer_is_per_test`)


def test_cuda_engine_logprobs_sleep_and_graph_recapture(checkpoints, monkeypatch):
    fixed_address_off(monkeypatch)
    path, _ = checkpoints["qwen2"]
    engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4, num_kv_blocks=128)
    cpu_model = load_lathe_model(path)
    params = SamplingParams(n=4, temperature=0.8, max_tokens=MAX, seed=5)
    first = engine.generate(PROMPTS, params)
    assert first.metrics["rollout/graph_captures"] >= 1
    prompts = [p for p in PROMPTS for _ in range(4)]
    for prompt, ids, lps in zip(prompts, first.token_ids, first.logprobs):
        ref = _teacher_forced(cpu_model, prompt, ids, 0.8)
        torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-3, rtol=0)

    def cycle(between=None):
        engine.sleep()
        held = between() if between else None
        engine.wake_up()
        out = engine.generate(PROMPTS, params)
        del held
        assert out.token_ids == first.token_ids
        return out.metrics["rollout/graph_captures"]

    # room to spare: the allocator keeps the freed cache and hands the same block back; the graphs stay
    address = engine.kv_cache.address
    assert cycle() == 0 and engine.kv_cache.address == address
    # the block taken while asleep: the cache lands elsewhere and the graphs are captured again
    assert cycle(lambda: torch.empty(engine.kv_cache.nbytes, dtype=torch.uint8, device="cuda")) >= 1
    assert engine.kv_cache.address != address
    # near the device's limit: sleep gives everything back to the driver, graphs included
    from lathe.engine import llm_engine
    monkeypatch.setattr(llm_engine, "KEEP_CACHED_FRACTION", 0.0)
    before = torch.cuda.memory_reserved()
    engine.sleep()
    assert not engine.runner.graphs.graphs and torch.cuda.memory_reserved() < before
    engine.wake_up()
    assert engine.generate(PROMPTS, params).token_ids == first.token_ids


def test_a_kept_cache_comes_back_in_place_after_an_update_s_backward(checkpoints, monkeypatch):
    """The update's backward runs on autograd's device thread, whose cuBLAS workspace is made at its first product,
    inside the sleeping engine's freed cache when that is the allocator's best fit (its one buffer, 256 MiB here): the
    engine frees the workspaces at wake-up, the cache lands where it was and the decode graphs are kept, step after
    step (at c811447 they were captured again at every 0.5B step)."""
    fixed_address_off(monkeypatch)
    path, _ = checkpoints["qwen2"]
    engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=64,
                                         num_kv_blocks=16384)
    assert engine.kv_cache.buffer.nbytes >= 128 << 20
    params = SamplingParams(n=4, temperature=0.8, max_tokens=MAX, seed=5)
    first = engine.generate(PROMPTS, params)
    address = engine.kv_cache.address
    for _ in range(3):
        engine.sleep()
        assert engine._cache_kept
        weight = torch.randn(512, 512, device="cuda", requires_grad=True)
        (weight @ weight).square().sum().backward()
        del weight
        engine.wake_up()
        assert engine.kv_cache.address == address
        out = engine.generate(PROMPTS, params)
        assert out.metrics["rollout/graph_captures"] == 0 and out.token_ids == first.token_ids


def fixed_address_on(monkeypatch):
    """The KV cache in `lathe.engine.vmm`'s memory for this test (the default, whatever the environment says)."""
    from lathe.engine import vmm
    monkeypatch.delenv("LATHE_KV_FIXED_ADDRESS", raising=False)
    vmm.supported.cache_clear()         # (and after each test: `_fixed_address_answer_is_per_test`)


@pytest.fixture(autouse=True)
def _fixed_address_answer_is_per_test():
    from lathe.engine import vmm
    yield
    vmm.supported.cache_clear()


def test_fixed_address_memory_comes_back_at_its_address_after_the_driver_lent_it_out(monkeypatch):
    """`vmm.FixedAddress`: unmapped, its memory goes to the driver (a tensor of nearly all the free memory fits);
    mapped again, new memory sits under the same address, zeroed; the bytes count as allocated while mapped."""
    from lathe import device as accel
    from lathe.engine import vmm
    monkeypatch.setenv("LATHE_KV_FIXED_ADDRESS", "0")
    assert not vmm.supported(0), "LATHE_KV_FIXED_ADDRESS=0 turns it off"
    vmm.supported.cache_clear()
    fixed_address_on(monkeypatch)
    assert vmm.supported(0)
    fixed = vmm.FixedAddress(3 << 30, torch.device("cuda"))
    raw = fixed.map()
    address, before = raw.data_ptr(), accel.memory_allocated("cuda")
    raw.fill_(7)
    assert int(raw[-1]) == 7 and before >= fixed.nbytes
    del raw
    fixed.unmap()
    assert accel.memory_allocated("cuda") == before - fixed.nbytes
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda")     # the cache's memory among it
    with pytest.raises(torch.OutOfMemoryError):
        fixed.map()
    del hog
    torch.cuda.empty_cache()
    raw = fixed.map()
    assert raw.data_ptr() == address and int(raw.max()) == 0
    del raw
    fixed.close()


def test_a_cache_freed_near_the_device_s_limit_keeps_its_address_and_its_graphs(checkpoints, monkeypatch):
    """Training that takes nearly all the device between two rollouts (here: a tensor of all its free memory) gets
    the KV cache's memory too (fixed-address memory goes back to the driver at sleep); at wake-up the cache comes
    back under the same addresses and the decode graphs are replayed, not captured again, with the same samples."""
    fixed_address_on(monkeypatch)
    path, _ = checkpoints["qwen2"]
    engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=64, num_kv_blocks=16384)
    nbytes = engine.kv_cache.buffer.nbytes
    assert engine.kv_cache._fixed is not None and nbytes >= 128 << 20
    params = SamplingParams(n=4, temperature=0.8, max_tokens=MAX, seed=5)
    first = engine.generate(PROMPTS, params)
    address = engine.kv_cache.address
    for _ in range(2):
        engine.sleep()
        free, _ = torch.cuda.mem_get_info()
        hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")   # more than the cache's bytes
        assert hog.nbytes > nbytes
        del hog
        engine.wake_up()
        assert engine.kv_cache.address == address
        out = engine.generate(PROMPTS, params)
        assert out.metrics["rollout/graph_captures"] == 0 and out.token_ids == first.token_ids
    # past KEEP_CACHED_FRACTION the allocator's cache goes to the driver, the graphs stay (the same release at a
    # wake-up that sizes a kept cache again: tests/engine/test_llm_engine.py, on the CPU)
    from lathe.engine import llm_engine
    monkeypatch.setattr(llm_engine, "KEEP_CACHED_FRACTION", 0.0)
    engine.sleep()
    assert not engine._cache_kept and engine.runner.graphs.graphs
    engine.wake_up()
    out = engine.generate(PROMPTS, params)
    assert out.metrics["rollout/graph_captures"] == 0 and out.token_ids == first.token_ids


def shared_prefix_runs(path, monkeypatch):
    """(CPU model, prompts, [output with the shared-prefix launch, output without]): the n=5 samples of three long
    prompts on CUDA with the Triton decode kernel (groups from 16 shared tokens), the launch's graphs checked to be
    captured exactly when it is on."""
    from lathe.engine import cuda_graph
    monkeypatch.setattr(cuda_graph, "PREFIX_MIN_TOKENS", 16)
    monkeypatch.setattr(cuda_graph, "PREFIX_MIN_TOKENS_WIDE", 16)
    cpu_model = load_lathe_model(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cpu_model.config.vocab_size, (n,), generator=g).tolist() for n in (45, 33, 21)]
    params = SamplingParams(n=5, temperature=0.8, max_tokens=MAX, seed=3)
    outs = []
    for shared in (True, False):
        engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4,
                                             num_kv_blocks=256, decode_backend="triton",
                                             shared_prefix_attention=shared)
        outs.append(engine.generate(prompts, params))
        assert any(key[3] > 0 for key in engine.runner.graphs.graphs) == shared
        del engine
    return cpu_model, [p for p in prompts for _ in range(5)], outs


def test_cuda_shared_prefix_graphs_give_teacher_forced_logprobs(checkpoints, monkeypatch):
    """The n samples of long prompts on shared blocks: graph steps attend over each prompt once per group of rows
    (the prefix launch before the Triton kernel, in the graph); each sample's log-probs equal a teacher-forced forward
    of the same model (fp32), and the tokens those of the engine without the prefix launch."""
    cpu_model, prompts, outs = shared_prefix_runs(checkpoints["qwen2"][0], monkeypatch)
    for prompt, ids, lps in zip(prompts, outs[0].token_ids, outs[0].logprobs):
        ref = _teacher_forced(cpu_model, prompt, ids, 0.8)
        torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-3, rtol=0)
    assert outs[0].token_ids == outs[1].token_ids


def test_wake_up_shrinks_an_auto_sized_cache_when_training_took_memory(checkpoints):
    path, _ = checkpoints["qwen2"]
    engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4,
                                         gpu_memory_utilization=0.3)
    before = engine.kv_cache.num_blocks
    per_block = sum(t.numel() * t.element_size() for t in engine.kv_cache.k + engine.kv_cache.v) // (before + 1)
    engine.sleep()
    # optimizer states, say: leave the 0.3 budget room for half the blocks the engine had
    total = torch.cuda.mem_get_info()[1]
    hog = torch.empty(int(total * 0.3) - accel.memory_allocated("cuda") - (before // 2) * per_block,
                      dtype=torch.uint8, device="cuda")
    engine.wake_up()
    assert engine.kv_cache.num_blocks < before and engine.block_manager.num_blocks == engine.kv_cache.num_blocks
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    assert all(len(t) == 4 for t in out.token_ids)
    del hog


@pytest.mark.parametrize("sampler", ["fused", "top_p"])
def test_cuda_overlapped_scheduling_equals_step_by_step(checkpoints, sampler):
    """On the GPU the next step's input tokens come from the device (graph buffers written by a gather) and the
    host reads each step's tokens one step late: the same tokens as resolving every step at once (fp32), with
    early stops, preemption and the fused sampler plain and with its top-p search."""
    path, _ = checkpoints["qwen2"]
    vocab = load_lathe_model(path).config.vocab_size
    params = SamplingParams(n=4, temperature=0.9, top_p=0.9 if sampler == "top_p" else 1.0, max_tokens=MAX, seed=2,
                            stop_token_ids=list(range(0, vocab, 11)))
    outs = []
    for overlap in (False, True):
        engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4, num_kv_blocks=24,
                                             reserve_new_tokens=False, async_scheduling=overlap)
        outs.append(engine.generate(PROMPTS, params))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[1].token_ids == outs[0].token_ids and outs[1].finish_reasons == outs[0].finish_reasons
    assert "stop" in outs[0].finish_reasons and outs[1].metrics["rollout/num_preemptions"] > 0
    assert all(out.metrics["timing_s/rollout_device_wait"] > 0 for out in outs)     # (each step's event waited on)
    assert_close_rel(torch.tensor([x for r in outs[1].logprobs for x in r]),     # batch shapes differ: the last
                     torch.tensor([x for r in outs[0].logprobs for x in r]), name="log-probs", rel=1e-4)   # bits may too


def test_cuda_graph_top_k_top_p_search_equals_the_torch_sampler(checkpoints, monkeypatch):
    """Decode steps replayed from CUDA graphs whose fused sampler searches top-k and top-p thresholds: the tokens and
    log-probs of an engine whose every step samples with the PyTorch sort path."""
    import lathe.engine.llm_engine as llm
    import lathe.engine.sampler as sampler
    path, _ = checkpoints["qwen2"]
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(llm, "fused_settings", lambda device, vocab, seqs: None)
            monkeypatch.setattr(sampler, "fused_settings", lambda device, vocab, seqs: None)
        engine = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4, num_kv_blocks=64)
        assert engine.runner.graphs is not None
        outs.append([engine.generate(PROMPTS, SamplingParams(n=3, temperature=t, top_k=k, top_p=p, max_tokens=MAX,
                                                              seed=7))
                     for t, k, p in ((0.8, 20, 1.0), (1.0, -1, 0.7), (1.2, 40, 0.9))])
        if fused:
            assert {key[1:3] for key in engine.runner.graphs.graphs} >= {(True, False), (False, True), (True, True)}
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert_close_rel(torch.tensor([x for r in a.logprobs for x in r]),
                         torch.tensor([x for r in b.logprobs for x in r]), name="log-probs", rel=1e-4)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_cuda_vl_engine_greedy_equals_transformers(tmp_path, family):
    """Image prompts on the GPU, fp32: CUDA graphs with the M-RoPE decode positions, Triton decode and the vision
    tower on CUDA give transformers' greedy tokens (n=2 samples share each image prompt). The images arrive on the
    CPU, as the data loader gives them."""
    from lathe.models.vl import load_lathe_vl_model

    from .test_multimodal import _hf_greedy, _prompts
    from models.vl_tiny import save_hf
    path, hf = save_hf(tmp_path, family)
    prompts, inputs = _prompts()
    engine = LatheEngine(load_lathe_vl_model(path, device="cuda"), eos_token_id=None, block_size=4, num_kv_blocks=128,
                         decode_backend="triton")
    assert engine.runner.graphs is not None
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6), multi_modal_inputs=inputs)
    for i, (prompt, mm) in enumerate(zip(prompts, inputs)):
        assert out.token_ids[2 * i] == out.token_ids[2 * i + 1] == _hf_greedy(hf, prompt, mm), f"prompt {i}"
