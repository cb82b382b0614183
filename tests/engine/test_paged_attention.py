"""Tests for lathe.engine.kv_cache + paged_attention: scattered blocks give plain causal attention's result."""

import logging

import pytest
import torch
import torch.nn.functional as F

from lathe.engine.kv_cache import KVCache
from lathe.engine import paged_attention
from lathe.engine.paged_attention import CachedPrefill, decode_attention, prefill_attention

from helpers import assert_close_rel


def test_prefill_and_decode_over_scattered_blocks_match_sdpa():
    g = torch.Generator().manual_seed(0)
    bs, L, hq, hkv, d = 4, 10, 4, 2, 8
    cache = KVCache(1, 8, bs, hkv, d)
    table = [6, 1, 4]                                         # out of order on purpose
    q, k, v = (torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
    cache.store(0, k, v, slots)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    # prefill of the last 6 tokens on top of a 4-token cached prefix
    out = prefill_attention(q[4:], cache.k[0], cache.v[0], [0, 6], [L], [table])
    assert_close_rel(out, ref[4:], name="prefill")
    dec = decode_attention(q[L - 1:], cache.k[0], cache.v[0], torch.tensor([table]), torch.tensor([L]))
    assert_close_rel(dec, ref[L - 1:], name="decode")
    cache.copy_blocks([(6, 0)])
    assert torch.equal(cache.k[0][0], cache.k[0][6])
    cache.store(0, k[:1] + 1, v[:1], torch.tensor([-1]))      # slot -1: nothing written
    assert torch.equal(cache.k[0][6, 0], k[0])


def test_the_batched_cached_prefill_equals_the_per_sequence_reference():
    """`CachedPrefill` (one masked SDPA over the group's padded contexts, in slices) against `prefill_attention`
    (one SDPA per sequence): ragged new-token counts and contexts, GQA, shared and scattered blocks."""
    g = torch.Generator().manual_seed(1)
    bs, hq, hkv, d = 4, 6, 2, 8
    cache = KVCache(1, 40, bs, hkv, d)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    contexts, new = [13, 7, 22, 5], [5, 7, 1, 3]               # one fresh sequence (7 of 7), one single token
    tables = [[3, 9, 1, 30], [5, 2], [3, 9, 1, 12, 17, 25], [8, 39]]    # the first and third share two blocks
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g)
    ref = prefill_attention(q, cache.k[0], cache.v[0], cu, contexts, tables)
    batched = CachedPrefill(cu, contexts, tables, q.device)
    for budget in (1 << 26, 1):                                 # all at once, and one sequence per slice
        assert_close_rel(batched(q, cache.k[0], cache.v[0], max_elements=budget), ref, rel=1e-5, name="prefill")


def _segments_reference(q, k, v, cu_q, cu_k, max_q, max_k, **_):
    """Flash varlen's contract, written out: segment s's queries are the last of its keys (causal at the end)."""
    outs = []
    a, c = cu_q.tolist(), cu_k.tolist()
    for s in range(len(a) - 1):
        n, ctx = a[s + 1] - a[s], c[s + 1] - c[s]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a[s]:a[s + 1]], k[c[s]:c[s + 1]], v[c[s]:c[s + 1]]))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_packed_cached_prefill_gathers_each_context_by_its_slots(monkeypatch, fp8):
    """`CachedPrefill`'s "varlen" form (flash over the contexts packed by their slots) with the flash call replaced by
    its contract written out: the per-sequence reference's result, tables longer than the contexts, blocks shared
    and out of order, an FP8 cache dequantised. The flash kernel itself is checked on a GPU
    (`test_the_packed_cached_prefill_on_flash_equals_the_padded_one`)."""
    monkeypatch.setattr(paged_attention, "causal_varlen", _segments_reference)
    monkeypatch.setattr(paged_attention, "varlen_aligns_causal_at_end", lambda *a: True)
    g = torch.Generator().manual_seed(2)
    bs, hq, hkv, d = 4, 6, 2, 8
    cache = KVCache(1, 40, bs, hkv, d, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
    k, v = (torch.randn(cache.shape, generator=g) for _ in range(2))
    slots = torch.arange(cache.shape[0] * bs)
    cache.store(0, k.flatten(0, 1), v.flatten(0, 1), slots)
    contexts, new = [13, 7, 22, 5], [5, 7, 1, 3]
    tables = [[3, 9, 1, 30, 11], [5, 2], [3, 9, 1, 12, 17, 25, 4], [8, 39]]    # the first's 5th block unused
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g)
    scales = (cache.k_scale[0], cache.v_scale[0]) if fp8 else None
    ref = prefill_attention(q, cache.k[0], cache.v[0], cu, contexts, tables, scales=scales)
    packed = CachedPrefill(cu, contexts, tables, q.device, backend="varlen")
    assert packed.rows is None                                  # the padded layout is not built
    assert_close_rel(packed(q, cache.k[0], cache.v[0], scales=scales), ref, rel=1e-5, name="packed prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("options", ["plain", "sinks", "window"])
def test_the_packed_cached_prefill_on_flash_equals_the_padded_one(options):
    """On CUDA in bf16 at Qwen3.5's full-attention heads (8 query heads over 2 KV heads of 256) and GPT-OSS's
    options: the "varlen" form of `CachedPrefill` against the padded SDPA form, contexts of hundreds of tokens
    continued by tens (the agent loop's next turns)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(3)
    bs, hq, hkv, d = 16, 8, 2, 256 if options == "plain" else 64
    cache = KVCache(1, 400, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    for buf in (cache.k[0], cache.v[0]):
        buf.copy_(torch.randn(buf.shape, generator=g, device="cuda"))
    contexts, new = [700, 333, 1500, 64, 900], [70, 1, 64, 64, 5]
    perm = torch.randperm(400, generator=g, device="cuda").tolist()
    tables, at = [], 0
    for c in contexts:
        tables.append(perm[at:at + -(-c // bs)])
        at += len(tables[-1])
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    kw = {"sinks": torch.randn(hq, generator=g, device="cuda")} if options == "sinks" else \
        {"window": 128} if options == "window" else {}
    padded = CachedPrefill(cu, contexts, tables, q.device)(q, cache.k[0], cache.v[0], **kw)
    packed = CachedPrefill(cu, contexts, tables, q.device, backend="varlen")(q, cache.k[0], cache.v[0], **kw)
    assert_close_rel(packed.float(), padded.float(), rel=2e-2, name=f"packed prefill ({options})")


def test_a_failing_candidate_is_logged_once_and_the_choice_names_every_candidate(caplog, monkeypatch):
    """`pick_fastest` (how "auto" picks the decode kernel): a candidate that raises is skipped with its error logged,
    once per process for the same error; the choice is logged with what each candidate gave."""
    monkeypatch.setattr(paged_attention, "_logged_failures", set())

    def time_one(name):
        if name == "triton":
            raise RuntimeError("no kernel image for this device")
        return 0.25
    with caplog.at_level(logging.INFO, logger="lathe.engine.paged_attention"):
        for _ in range(2):
            assert paged_attention.pick_fastest(("triton", "torch"), time_one, "decode attention") == \
                ("torch", {"torch": 0.25})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'triton'" in warnings[0] and "no kernel image for this device" in warnings[0]
    choices = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(choices) == 2 and all("chose 'torch'" in c and "triton failed" in c and "torch 0.25 ms" in c
                                     for c in choices)


def test_when_no_candidate_runs_the_error_lists_each_with_its_error(monkeypatch):
    monkeypatch.setattr(paged_attention, "_logged_failures", set())

    def time_one(name):
        raise {"triton": RuntimeError("PTX too new"), "torch": ValueError("bad shape")}[name]
    with pytest.raises(RuntimeError) as info:
        paged_attention.pick_fastest(("triton", "torch"), time_one, "decode attention on cuda:0")
    message = str(info.value)
    assert "decode attention on cuda:0" in message and "no candidate ran" in message
    assert "triton: RuntimeError: PTX too new" in message and "torch: ValueError: bad shape" in message


def test_a_measured_choice_is_remembered_on_the_machine_and_checked_before_it_is_taken(tmp_path, monkeypatch, caplog):
    """`pick_fastest(remember=)`: the first measurement's choice is kept in the cache directory, and a later process
    (another rank, a resumed run) takes it, even where its own timing would have chosen the other, once it has checked
    that the remembered candidate still runs; when it fails now, all are measured again and the new choice kept. A
    choice is remembered per probe: another key measures for itself."""
    from lathe.engine import choices
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paged_attention, "_logged_failures", set())
    key = "decode attention (test probe) | a GPU"
    timed = []

    def timing(times, failing=()):
        def time_one(name):
            timed.append(name)
            if name in failing:
                raise RuntimeError("no kernel image for this device")
            return times[name]
        return time_one
    pick = paged_attention.pick_fastest
    assert pick(("triton", "torch"), timing({"triton": 1.0, "torch": 1.1}), "attn", remember=key)[0] == "triton"
    assert choices.recall(key) == "triton" and timed == ["triton", "torch"]
    timed.clear()
    with caplog.at_level(logging.INFO, logger="lathe.engine.paged_attention"):
        assert pick(("triton", "torch"), timing({"triton": 1.2, "torch": 1.1}), "attn", remember=key) == \
            ("triton", {"triton": 1.2})                      # remembered: only it is run, to check it runs
    assert timed == ["triton"] and any("as measured before" in r.getMessage() for r in caplog.records)
    timed.clear()
    assert pick(("triton", "torch"), timing({"triton": 1.0, "torch": 1.1}, ["triton"]), "attn", remember=key)[0] == \
        "torch"
    assert choices.recall(key) == "torch" and timed == ["triton", "triton", "torch"]
    other = "decode attention (another probe) | a GPU"
    assert pick(("triton", "torch"), timing({"triton": 1.0, "torch": 1.1}), "attn", remember=other)[0] == "triton"
    assert (choices.recall(key), choices.recall(other)) == ("torch", "triton")


def test_an_unwritable_cache_measures_in_each_process(tmp_path, monkeypatch):
    from lathe.engine import choices
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LATHE_CACHE_DIR", str(blocker / "cache"))         # below a file: cannot be created
    key = "decode attention (test probe) | a GPU"
    assert choices.key("decode attention", "cpu") is None                # (off an accelerator: nothing to keep)
    for times, want in (({"triton": 1.0, "torch": 1.1}, "triton"), ({"triton": 1.2, "torch": 1.1}, "torch")):
        assert paged_attention.pick_fastest(("triton", "torch"), times.get, "attn", remember=key)[0] == want


@pytest.mark.parametrize("why", ["no locks here", "held elsewhere"])
def test_a_lock_that_cannot_be_taken_measures_without_remembering(tmp_path, monkeypatch, caplog, why):
    """A file system without locks (some NFS, Lustre), or a lock another process holds past the timeout: this
    process measures its own choice and says why, once; the engine starts all the same."""
    import errno
    import fcntl

    from lathe.engine import choices
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choices, "_warned", set())
    holder = None
    if why == "no locks here":
        def flock(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")
        monkeypatch.setattr(fcntl, "flock", flock)
    else:
        tmp_path.mkdir(exist_ok=True)
        holder = open(choices.path().with_suffix(".lock"), "a")
        fcntl.flock(holder, fcntl.LOCK_EX)                    # (another open file: a lock of its own)
        monkeypatch.setattr(choices, "LOCK_TIMEOUT_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="lathe.engine.choices"):
        for _ in range(2):
            assert paged_attention.pick_fastest(("triton", "torch"), {"triton": 1.0, "torch": 1.1}.get, "attn",
                                                remember="decode attention (test probe) | a GPU")[0] == "triton"
    if holder is not None:
        holder.close()
    assert not choices.path().exists()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "not remembered" in said[0] and ("No locks" in said[0] or "held" in said[0]), said


def test_a_split_decode_step_allocates_its_shared_merge_counters_once():
    """`DecodeAttention` with the Triton kernel's split-K merge: one zeroed set of counters (rows x KV heads) for all
    the step's layers, made with the step (a latent-attention property once cut this allocation off unseen: the
    kernel then fell back to fresh zeros at every layer)."""
    from lathe.engine.kv_cache import KVCache
    from lathe.engine.step_attention import DecodeAttention
    cache = KVCache(2, 8, 4, 3, 16)
    tables = torch.zeros(5, 2, dtype=torch.int32)
    step = DecodeAttention(cache, torch.zeros(5, dtype=torch.long), tables, torch.ones(5, dtype=torch.int32),
                           backend="triton", num_splits=4)
    assert step.counters is not None and step.counters.shape == (5 * 3,) and not step.counters.any()
    assert DecodeAttention(cache, torch.zeros(5, dtype=torch.long), tables, torch.ones(5, dtype=torch.int32),
                           backend="torch").counters is None
    assert step.latent is False


def test_one_kv_head_attends_as_the_grouped_form_without_repeating_the_context():
    """DeepSeek-V3's latent cache has one KV "head" of 576: the torch decode folds the query heads into one head's
    queries, and a packed prefill past flash attention's head sizes repeats the KV head (so SDPA's memory-efficient
    kernel runs, not the math form): both equal SDPA's grouped attention (norm-relative, float32)."""
    from helpers import assert_close_rel
    from lathe.models.attention import PackedAttention
    g = torch.Generator().manual_seed(0)
    blocks, block, hq, d = 6, 4, 4, 264
    kc, vc = (torch.randn(blocks, block, 1, d, generator=g) for _ in range(2))
    q = torch.randn(3, hq, d, generator=g)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([9, 6, 2], dtype=torch.int32)
    got = paged_attention.decode_attention(q, kc, vc, tables, lens)
    k, v = (paged_attention.gathered(c, None, tables, q.dtype).transpose(1, 2) for c in (kc, vc))
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)
    assert_close_rel(got, want[:, :, 0], rel=1e-5, name="decode")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    qp, kp, vp = torch.randn(12, hq, d, generator=g), torch.randn(12, 1, d, generator=g), torch.randn(12, 1, d, generator=g)
    got = PackedAttention(cu, 7, "sdpa")(qp, kp, vp)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1)[None] for x in (qp, kp, vp)), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        for a, b in ((0, 5), (5, 12))])
    assert_close_rel(got, want, rel=1e-5, name="packed prefill")
