"""The Triton paged-decode kernel, run in Triton's CPU interpreter, against the PyTorch reference."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lathe.engine.paged_attention import decode_attention  # noqa: E402
from helpers import assert_close_rel  # noqa: E402
from models.lathe_tiny import save_hf  # noqa: E402


@pytest.fixture(scope="module")
def kernel(triton_interpreter):
    """lathe.engine.triton_decode, its kernel run by Triton's CPU interpreter."""
    from lathe.engine import triton_decode
    return triton_decode


@pytest.mark.parametrize("batch,hq,hkv,dim,page,splits", [
    (3, 14, 2, 64, 16, 1),      # Qwen2.5-0.5B's GQA group of 7, one split
    (2, 8, 8, 32, 4, 3),        # no GQA, three splits (some empty for short contexts)
    (4, 12, 4, 48, 16, 2),      # head_dim not a power of two
])
def test_kernel_equals_reference(kernel, batch, hq, hkv, dim, page, splits):
    g = torch.Generator().manual_seed(batch * 7 + splits)
    blocks = 40
    kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
    lens = torch.randint(1, 120, (batch,), generator=g)
    lens[0] = 1                                              # a one-token context
    width = -(-int(lens.max()) // page)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(batch)]).int()
    q = torch.randn(batch, hq, dim, generator=g)
    out = kernel.paged_decode(q, kc, vc, tables, lens.int(), num_splits=splits, block_n=32)
    ref = decode_attention(q, kc, vc, tables.long(), lens)
    assert_close_rel(out, ref, name="paged decode")


def test_split_merge_counters_are_shared_and_left_at_zero(kernel):
    """Several layers of a step share one counter set: each split launch merges in-kernel and leaves it zeroed."""
    g = torch.Generator().manual_seed(11)
    blocks, page, batch, hq, hkv, dim = 24, 4, 3, 8, 2, 16
    tables = torch.stack([torch.randperm(blocks, generator=g)[:10] for _ in range(batch)]).int()
    lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    counters = torch.zeros(batch * hkv, dtype=torch.int32)
    for layer in range(3):
        kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
        q = torch.randn(batch, hq, dim, generator=g)
        out = kernel.paged_decode(q, kc, vc, tables, lens, num_splits=4, block_n=16, counters=counters)
        assert_close_rel(out, decode_attention(q, kc, vc, tables.long(), lens.long()), name=f"layer {layer}")
        assert counters.eq(0).all()
    with pytest.raises(ValueError, match="counters"):
        kernel.paged_decode(q, kc, vc, tables, lens, num_splits=2, counters=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("min_split", [16, 40, 1000])
def test_a_least_split_length_uses_the_first_splits_and_merges_those(kernel, min_split):
    """`min_split`: each split takes at least that many tokens, so short contexts fill only the first splits; the
    rest write nothing and the merge reads the used ones: the reference's output, the counters left at zero over
    several layers, with the step's new token (stored by the split that holds its position) and sinks."""
    from lathe.engine.triton_store import rope_store_kv
    g = torch.Generator().manual_seed(min_split)
    page, batch, hq, hkv, dim, width = 4, 5, 8, 2, 16, 30
    lens = torch.tensor([1, 15, 17, 64, 113], dtype=torch.int32)
    blocks = batch * width + 2
    tables = torch.randperm(blocks, generator=g)[:batch * width].view(batch, width).int()
    counters = torch.zeros(batch * hkv, dtype=torch.int32)
    sinks = torch.randn(hq, generator=g)
    for layer in range(2):
        kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
        q = torch.randn(batch, hq, dim, generator=g)
        out = kernel.paged_decode(q, kc, vc, tables, lens, num_splits=4, block_n=8, counters=counters,
                                  min_split=min_split, sinks=sinks)
        assert_close_rel(out, decode_attention(q, kc, vc, tables.long(), lens.long(), sinks=sinks),
                         name=f"layer {layer}")
        assert counters.eq(0).all()
    pos = lens.long() - 1
    slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    k, v = (torch.randn(batch, hkv, dim, generator=g) for _ in range(2))
    angles = torch.randn(batch, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_rot = rope_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
    out = kernel.paged_decode(q, kc, vc, tables, lens, num_splits=4, block_n=8, counters=counters,
                              min_split=min_split, new_kv=(k, v, cos, sin, slots))
    assert torch.equal(vc, ref_v), "each row's new token stored once, by the split that holds its position"
    assert_close_rel(out, decode_attention(q_rot, ref_k, ref_v, tables.long(), lens.long()), name="new token")
    assert counters.eq(0).all()
    with pytest.raises(ValueError, match="min_split"):
        kernel.paged_decode(q, kc, vc, tables, lens, num_splits=4, counters=counters, min_split=-1)


def test_engine_with_triton_decode_equals_torch_decode(kernel, tmp_path):
    """The whole engine (prefill single-token group and decode) on the kernel gives the reference's output."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model

    path, _ = save_hf(tmp_path, "qwen2")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = LatheEngine(load_lathe_model(path, torch.float32), eos_token_id=None, block_size=4,
                             num_kv_blocks=32, decode_backend=backend)
        assert engine.runner.decode_backend == backend
        outs[backend] = engine.generate(prompts, params)
    assert outs["triton"].token_ids == outs["torch"].token_ids
    assert_close_rel(sum(outs["triton"].logprobs, []), sum(outs["torch"].logprobs, []), name="log-probs")


def test_num_splits_fill_the_device(kernel):
    assert kernel.choose_num_splits(256, 2, 132) == 1
    assert kernel.choose_num_splits(1, 2, 132) == 16
    assert kernel.choose_num_splits(8, 4, 132) == 9
    # half a tile's bytes (an FP8 cache, head_dim 64): about four programs an SM, a full batch left whole
    for narrow in ({"fp8": True}, {"head_dim": 64}):
        assert kernel.choose_num_splits(32, 2, 132, **narrow) == 8
        assert kernel.choose_num_splits(16, 2, 132, **narrow) == 16
        assert kernel.choose_num_splits(256, 2, 132, **narrow) == 1
        assert kernel.choose_num_splits(128, 2, 132, **narrow) == 2
    assert kernel.choose_num_splits(32, 2, 132, head_dim=128) == 5


def test_no_dependent_launch_on_the_cpu_or_under_the_interpreter(kernel, monkeypatch):
    """`pdl_available`: never on the CPU, under the interpreter or below compute capability 9 (the engine then
    launches plainly), with a capability faked here so that each condition is what decides; the GPU tests check the
    dependent launch itself (tests/engine/test_engine_gpu.py)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernel, "nvidia_capability", lambda device: (9, 0))
    assert not kernel.pdl_available(torch.device("cpu"))
    assert not kernel.pdl_available(cuda)                        # the interpreter runs these tests
    monkeypatch.setattr(kernel, "interpreted", lambda: False)
    assert kernel.pdl_available(cuda) == hasattr(triton.language.extra.cuda, "gdc_wait")   # this Triton's support
    monkeypatch.setattr(kernel, "nvidia_capability", lambda device: (8, 0))
    assert not kernel.pdl_available(cuda)
    monkeypatch.setattr(kernel, "nvidia_capability", lambda device: None)   # ROCm or no NVIDIA GPU
    assert not kernel.pdl_available(cuda)


def test_fused_sampler_equals_torch_sampler(kernel):
    """The fused Triton sampler draws the same tokens as the PyTorch path from the same uniforms (which it computes
    itself from seed and output position), log-probs too; a row's chunks of the vocabulary combine exactly."""
    from lathe.engine.sampler import sample
    from lathe.engine.sequence import Sequence, SequenceParams
    from lathe.engine.triton_sample import fused_sample
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=g) * 3
    logits[2, 4321] = 40.0                                   # a peaked row
    logits[5, 100] = logits[5, 2600] = 50.0                  # a tie across chunks: the first index wins
    params = [SequenceParams(temperature=t) for t in (1.0, 0.7, 1.0, 0, 1.3, 0)]
    seqs = [Sequence([1], p, None if p.greedy else 50 + i) for i, p in enumerate(params)]
    ref_tok, ref_lp = sample(logits, seqs)
    temps = torch.tensor([p.logprob_temperature for p in params])
    greedy = torch.tensor([int(p.greedy) for p in params], dtype=torch.int32)
    seeds = torch.tensor([s.seed or 0 for s in seqs])
    out = fused_sample(logits, temps, greedy, seeds, torch.zeros(6, dtype=torch.long), chunk=512)
    assert out[0].long().tolist() == ref_tok
    assert out[0, 2] == 4321 and out[0, 3] == int(logits[3].argmax()) and out[0, 5] == 100
    assert_close_rel(out[1], ref_lp, name="log-probs")


def test_fused_sampler_uniforms_match_the_host(kernel):
    """Over 63-bit seeds and late output positions, with flat logits (every draw depends on the uniform's low bits),
    the kernel's splitmix64 draws what the host's numpy `uniforms` draw."""
    from lathe.engine.sampler import sample
    from lathe.engine.sequence import Sequence, SequenceParams
    from lathe.engine.triton_sample import fused_sample
    g = torch.Generator().manual_seed(1)
    rows, vocab = 48, 3000
    logits = torch.randn(rows, vocab, generator=g) * 0.1
    p = SequenceParams(temperature=1.0)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 5000, (rows,), generator=g)
    seqs = []
    for i in range(rows):
        s = Sequence([1], p, int(seeds[i]))
        s.token_ids += [0] * int(positions[i])          # output position = tokens generated so far
        seqs.append(s)
    ref_tok, _ = sample(logits, seqs)
    out = fused_sample(logits, torch.ones(rows), torch.zeros(rows, dtype=torch.int32), seeds, positions, chunk=256)
    assert out[0].long().tolist() == ref_tok


@pytest.mark.parametrize("batch,hq,hkv,dim,page,splits", [
    (3, 14, 2, 64, 16, 1),      # Qwen2.5-0.5B's group of 7, one split
    (4, 8, 4, 48, 4, 3),        # three splits, some empty for short contexts; head_dim not a power of two
])
def test_kernel_with_the_new_token_equals_rope_store_then_attention(kernel, batch, hq, hkv, dim, page, splits):
    """`new_kv`: q and the step's k arrive before RoPE (strided views of one q/k/v projection, as the layers hand
    them), the launch rotates them, stores k and v at the slots and reads them back with the rest of the context:
    the cache and the output equal a RoPE+store launch followed by the plain kernel over the cache (the output bit for
    bit: the same arithmetic in the same order)."""
    from lathe.engine.triton_store import rope_store_kv
    g = torch.Generator().manual_seed(batch + splits)
    lens = torch.randint(1, 90, (batch,), generator=g)
    lens[0] = 1                                              # the new token alone
    width = -(-int(lens.max()) // page)
    blocks = batch * width + 3                               # each sequence's own blocks, as the engine's are
    kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
    tables = torch.randperm(blocks, generator=g)[:batch * width].view(batch, width).int()
    pos = lens - 1
    slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    qkv = torch.randn(batch, (hq + 2 * hkv) * dim, generator=g)
    q, k, v = (x.view(batch, -1, dim) for x in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    angles = torch.randn(batch, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_rot = rope_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
    ref = kernel.paged_decode(q_rot, ref_k, ref_v, tables, lens.int(), num_splits=splits, block_n=16)
    out = kernel.paged_decode(q, kc, vc, tables, lens.int(), num_splits=splits, block_n=16,
                              new_kv=(k, v, cos, sin, slots))
    assert_close_rel(kc, ref_k, rel=1e-6, name="k cache")
    assert torch.equal(vc, ref_v)
    assert torch.equal(out, ref), "the token read back from the cache: the same arithmetic as store + plain kernel"
    assert_close_rel(out, decode_attention(q_rot, ref_k, ref_v, tables.long(), lens), name="reference")


def _shared_tables(g, groups: list[int], width: int, shared: list[int], blocks: int) -> torch.Tensor:
    """Block tables of consecutive row groups (sizes `groups`), the rows of group i sharing its first `shared[i]`
    blocks and owning the rest."""
    ids = iter(torch.randperm(blocks, generator=g).tolist())
    rows = []
    for size, same in zip(groups, shared):
        head = [next(ids) for _ in range(same)]
        rows += [head + [next(ids) for _ in range(width - same)] for _ in range(size)]
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("splits,prefix_splits,min_split", [(1, 1, 0), (1, 2, 0), (3, 2, 0), (3, 2, 12)])
@pytest.mark.parametrize("new_token", [False, True])
def test_shared_prefix_launch_equals_the_reference(kernel, splits, prefix_splits, min_split, new_token):
    """`prefix`: groups of rows attend over their shared blocks in one launch (each group's query heads one tile),
    each row over the rest in the main launch, which merges both (one split or several); rows outside any group and
    a group whose prefix ends inside a block take the plain path. With the step's new token (RoPE and store in the
    launch) the prefix launch rotates q as the main one does. Sinks join the merge."""
    from lathe.engine.triton_store import rope_store_kv
    g = torch.Generator().manual_seed(splits * 10 + prefix_splits + new_token)
    page, hq, hkv, dim, width = 4, 14, 2, 32, 10
    tables = _shared_tables(g, [3, 2, 1, 1], width, [5, 2, 0, 0], 80)
    lens = torch.tensor([23, 30, 21, 12, 15, 33, 9], dtype=torch.int32)
    batch = len(lens)
    kc, vc = (torch.randn(80, page, hkv, dim, generator=g) for _ in range(2))
    groups, plens = kernel.shared_prefixes(tables.numpy(), lens.numpy(), page, max_rows=4, min_tokens=4,
                                           capacity=4)
    assert groups[:2] == [(0, 3, 20), (3, 2, 8)] and plens.tolist() == [20, 20, 20, 8, 8, 0, 0]
    prefix = kernel.SharedPrefix(torch.tensor(groups, dtype=torch.int32), torch.from_numpy(plens), prefix_splits, 4)
    sinks = torch.randn(hq, generator=g)
    counters = torch.zeros(batch * hkv, dtype=torch.int32)
    if not new_token:
        q = torch.randn(batch, hq, dim, generator=g)
        out = kernel.paged_decode(q, kc, vc, tables, lens, num_splits=splits, block_n=8, counters=counters,
                                  prefix=prefix, sinks=sinks, min_split=min_split)
        ref = decode_attention(q, kc, vc, tables.long(), lens.long(), sinks=sinks)
    else:
        pos = lens.long() - 1
        slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
        q, k, v = (torch.randn(batch, h, dim, generator=g) for h in (hq, hkv, hkv))
        angles = torch.randn(batch, dim // 2, generator=g)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        ref_k, ref_v = kc.clone(), vc.clone()
        q_rot = rope_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
        ref = decode_attention(q_rot, ref_k, ref_v, tables.long(), lens.long(), sinks=sinks)
        out = kernel.paged_decode(q, kc, vc, tables, lens, num_splits=splits, block_n=8, counters=counters,
                                  prefix=prefix, sinks=sinks, new_kv=(k, v, cos, sin, slots), min_split=min_split)
        assert torch.equal(vc, ref_v)
    assert_close_rel(out, ref, name="shared-prefix decode")
    assert counters.eq(0).all()


def test_shared_prefixes_group_rows_by_their_common_blocks(kernel):
    """Runs of rows with the same first block, cut at `max_rows`; each group's prefix ends at its first differing
    block and before its shortest row's last position; short prefixes and lone rows are left to the rows."""
    page = 4
    g = torch.Generator().manual_seed(3)
    tables = _shared_tables(g, [5, 2, 2, 1], 8, [6, 1, 4, 0], 60).numpy()
    lens = [30, 30, 30, 30, 14, 30, 30, 30, 30, 30]
    groups, plens = kernel.shared_prefixes(tables, lens, page, max_rows=3, min_tokens=8)
    # rows 0-2 (24 tokens), rows 3-4 (the shortest's last position 13: 13 tokens), 5-6 share one block (4 < 8: left),
    # 7-8 share 4 blocks, row 9 alone
    assert groups == [(0, 3, 24), (3, 2, 13), (7, 2, 16)]
    assert plens.tolist() == [24, 24, 24, 13, 13, 0, 0, 16, 16, 0]
    assert kernel.shared_prefixes(tables, lens, page, max_rows=3, min_tokens=8, capacity=5)[0][3:] == [(0, 0, 0)] * 2
    with pytest.raises(ValueError, match="capacity"):
        kernel.shared_prefixes(tables, lens, page, max_rows=3, min_tokens=8, capacity=2)
    assert kernel.prefix_splits([(0, 0, 0)], 2, 128, 132) == 0
    assert kernel.prefix_splits([(0, 8, 2048)] * 32, 2, 64, 132) == 4    # 0.5B's heads: 4 programs a (group, head)
    assert kernel.prefix_splits([(0, 8, 2048)] * 32, 2, 128, 132) == 2   # 1.5B's: 2
    assert kernel.prefix_splits([(0, 8, 2048)] * 32, 4, 128, 132) == 1   # 7B's: 1
    assert kernel.prefix_splits([(0, 8, 2048)] * 20, 2, 128, 132) == 2   # 3.3: a power of two
    assert kernel.prefix_splits([(0, 8, 2048)] * 2, 2, 128, 132) == 4    # capped
