"""DecodeGraphs' device block tables: which rows a step rewrites (the bookkeeping runs on CPU here)."""

import pytest
import torch

from lathe.device import Staging
from lathe.engine.block_manager import BlockManager
from lathe.engine.cuda_graph import DecodeGraphs, batch_buckets
from lathe.engine.sequence import Sequence


def _graphs(rows: int, width: int) -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)           # no CUDA: only the table mirror is exercised
    g.max_batch = rows
    g.tables = torch.zeros(rows, width, dtype=torch.int32)
    g.host_tables = Staging((rows, width), torch.int32, torch.device("cpu"))
    g.reset()
    return g


def test_buckets_cover_every_batch_size():
    buckets = batch_buckets(100)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 100
    assert all(any(b >= n for b in buckets) for n in range(1, 101))


def test_buckets_follow_the_capture_sizes_capped_at_the_batch():
    """rollout.cudagraph_capture_sizes: those sizes only (a larger step runs eagerly), none above the engine's batch."""
    assert batch_buckets(64, [48, 4, 12, 4]) == [4, 12, 48]
    assert batch_buckets(8, [4, 16, 32]) == [4, 8]
    assert batch_buckets(8, []) == batch_buckets(8) == [1, 2, 4, 8]


def test_tables_follow_new_blocks_copy_on_write_and_reallocation():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a, b = Sequence(list(range(6))), Sequence(list(range(10, 13)))
    bm.allocate(a)
    bm.allocate(b)
    g = _graphs(4, 8)

    def check():
        g._sync_tables([a, b])
        for row, seq in enumerate((a, b)):
            assert g.tables[row, :len(seq.block_table)].tolist() == seq.block_table

    check()
    for _ in range(3):                                   # a crosses into a new block
        a.append_token(1, 0.0)
        bm.may_append(a)
        check()
    first = list(a.block_table)
    bm.deallocate(a)                                     # preempted; readmitted with the same number of blocks
    a.block_table = [first[1], first[0], first[2]]       # and the same last block: only the epoch tells
    check()


def test_tables_when_a_batch_starts_blocks_together_and_rows_change_hands():
    """Rows that only gained a block get that entry written, the others whole; the device tables match the
    sequences' after every step, whichever rows changed."""
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    seqs = [Sequence(list(range(k, k + 4))) for k in (0, 10, 20)]       # each fills its first block exactly
    for s in seqs:
        bm.allocate(s)
    g = _graphs(4, 8)

    def check(batch):
        g._sync_tables(batch)
        for row, seq in enumerate(batch):
            assert g.tables[row, :len(seq.block_table)].tolist() == seq.block_table

    check(seqs)
    for _ in range(9):                                   # all three start a block at the same steps
        for s in seqs:
            s.append_token(1, 0.0)
            bm.may_append(s)
        check(seqs)
    check([seqs[2], seqs[0], seqs[1]])                    # the rows change hands: rewritten whole
    check(seqs)


class _Replay:
    """A captured graph's stand-in on the CPU: replaying reruns the step over the static buffers."""

    def __init__(self, graphs, key):
        self.graphs, self.key = graphs, key

    def replay(self):
        self.graphs.outputs[self.key] = self.graphs._forward(self.key)


def _graphs_on_cpu(monkeypatch):
    """The decode graphs' step on the CPU, standing in for CUDA: step-inputs kernel and fused sampler on, captures
    replaced by `_Replay`."""
    import lathe.engine.llm_engine as llm
    from lathe.engine.sampler import fused_settings
    monkeypatch.setattr("lathe.device.multiprocessor_count", lambda device: 4)
    monkeypatch.setattr("lathe.engine.triton_step.available", lambda device: True)
    monkeypatch.setattr(llm, "fused_settings", lambda device, vocab, seqs: fused_settings(
        torch.device("cuda"), vocab, seqs))
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, b: self.graphs.__setitem__(b, _Replay(self, b)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_graph_step_on_cpu_equals_the_eager_engine(checkpoints, triton_interpreter, monkeypatch, kv_cache_dtype):
    """The graph step's own work (one input buffer, slots and lengths from positions and block tables, padding rows
    on the scratch slot, the fused sampler drawing from seeds and output positions, the KV store kernel) run
    eagerly on the CPU: the same tokens as the plain engine, with overlapped scheduling, early stops, preemption,
    changing buckets, and top-p batches (the fused sampler's search in the graph step, the PyTorch sort in the
    plain engine). Slots, lengths and RoPE rows come from the step-inputs kernel and its table, as on CUDA: the
    graph steps never call the model's RotaryEmbedding (only prefills do). With an FP8 KV cache (its scales stored and
    read by the graph step as by the plain one), the top-p batch is left out (time)."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from helpers import assert_close_rel
    from .conftest import PROMPTS

    path, _ = checkpoints["qwen2"]
    _graphs_on_cpu(monkeypatch)
    from lathe.models.rope import RotaryEmbedding
    in_step, rope_in_steps = [False], []                        # RoPE computed inside a graph step, if ever
    rope_forward, graph_forward = RotaryEmbedding.forward, DecodeGraphs._forward

    def counted_rope(self, pos, dtype):
        if in_step[0]:
            rope_in_steps.append(pos.numel())
        return rope_forward(self, pos, dtype)

    def flagged_step(self, key):
        in_step[0] = True
        try:
            return graph_forward(self, key)
        finally:
            in_step[0] = False
    monkeypatch.setattr(RotaryEmbedding, "forward", counted_rope)
    monkeypatch.setattr(DecodeGraphs, "_forward", flagged_step)
    vocab = load_lathe_model(path).config.vocab_size
    for top_p in (1.0, 0.9) if kv_cache_dtype == "auto" else (1.0,):
        params = SamplingParams(n=3, temperature=0.9, top_p=top_p, max_tokens=10, seed=4,
                                stop_token_ids=list(range(0, vocab, 13)))
        outs = []
        for graphs in (False, True):
            engine = LatheEngine(load_lathe_model(path), eos_token_id=None, block_size=4, num_kv_blocks=24,
                                 reserve_new_tokens=False, async_scheduling=graphs, kv_cache_dtype=kv_cache_dtype)
            if graphs:
                engine.runner.graphs = DecodeGraphs(engine.runner, 16)
                assert engine.runner.graphs.rope_table is not None
            outs.append(engine.generate(PROMPTS, params))
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not rope_in_steps, "a graph step computed RoPE instead of taking its rows from the table"
        assert outs[1].token_ids == outs[0].token_ids and outs[1].finish_reasons == outs[0].finish_reasons
        assert "stop" in outs[0].finish_reasons and outs[1].metrics["rollout/num_preemptions"] > 0
        assert_close_rel(torch.tensor(sum(outs[1].logprobs, [])), torch.tensor(sum(outs[0].logprobs, [])),
                         name="log-probs")


def test_graph_steps_with_shared_prefixes_equal_the_eager_engine(checkpoints, triton_interpreter, monkeypatch):
    """The n samples of two prompts share the prompts' blocks: graph steps on the Triton kernel (run by the
    interpreter) attend over each shared prompt once per group of rows and give the plain engine's tokens and
    log-probs, while rows stop early (the batch shrinks and its groups are found again) and a group is cut at its
    most rows; without groups (shared_prefix_attention=False) the plain graph."""
    import lathe.engine.cuda_graph as cg
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from helpers import assert_close_rel

    path, _ = checkpoints["qwen2"]
    _graphs_on_cpu(monkeypatch)
    monkeypatch.setattr(cg, "PREFIX_MIN_TOKENS", 8)
    monkeypatch.setattr(cg, "PREFIX_MIN_TOKENS_WIDE", 8)
    vocab = load_lathe_model(path).config.vocab_size
    prompts = [list(range(1, 23)), list(range(30, 49))]          # 22 and 19 tokens: 5 and 4 full blocks of 4
    params = SamplingParams(n=5, temperature=0.9, max_tokens=8, seed=4, stop_token_ids=list(range(0, vocab, 11)))
    outs, keys, found = [], [], []
    sync_prefix = DecodeGraphs._sync_prefix

    def recorded(self, batch, lens):
        sync_prefix(self, batch, lens)
        found.append(int(self.prefix_lens[:batch].gt(0).sum()) if self.prefix_split else 0)
    monkeypatch.setattr(DecodeGraphs, "_sync_prefix", recorded)
    for graphs, shared in ((False, False), (True, True), (True, False)):
        engine = LatheEngine(load_lathe_model(path), eos_token_id=None, block_size=4, num_kv_blocks=60,
                             reserve_new_tokens=False, async_scheduling=graphs, decode_backend="triton",
                             shared_prefix_attention=shared)
        if graphs:
            engine.runner.graphs = DecodeGraphs(engine.runner, 16)
            assert engine.runner.graphs.prefix_rows == (min(8, 64 // 7) if shared else 0)   # a GQA group of 7
            engine.runner.graphs.prefix_rows = 3 if shared else 0     # each prompt's 5 rows as groups of 3 and 2
        outs.append(engine.generate(prompts, params))
        keys.append(set(engine.runner.graphs.graphs) if graphs else set())
    assert max(k[3] for k in keys[1]) > 0 and {k[3] for k in keys[2]} == {0}
    assert found[0] == 10 and min(found) < 10, found      # all rows grouped at first, fewer once rows stop
    assert "stop" in outs[0].finish_reasons
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids and out.finish_reasons == outs[0].finish_reasons
        assert_close_rel(torch.tensor(sum(out.logprobs, [])), torch.tensor(sum(outs[0].logprobs, [])),
                         name="log-probs")


def test_a_capture_that_runs_out_of_memory_is_tried_once_more_after_emptying_the_cache(monkeypatch):
    """The graphs' pool takes new memory from the driver: after a training step the caching allocator may hold most
    of the device unused, so a capture that fails for memory gives it back (`empty_cache`) and captures again; a
    second failure is the caller's."""
    from types import SimpleNamespace
    from lathe import device as accel
    emptied, tries = [], []

    def capture_once(key):
        tries.append(key)
        if len(tries) == 1 or key == "twice":
            raise torch.OutOfMemoryError("CUDA out of memory")
        graphs.graphs[key] = "graph"
    graphs = SimpleNamespace(graphs={}, outputs={}, runner=SimpleNamespace(device=torch.device("cpu")),
                             _capture_once=capture_once)
    monkeypatch.setattr(accel, "empty_cache", lambda device: emptied.append(device))
    DecodeGraphs._capture(graphs, "k")
    assert tries == ["k", "k"] and graphs.graphs == {"k": "graph"} and len(emptied) == 1
    with pytest.raises(torch.OutOfMemoryError):
        DecodeGraphs._capture(graphs, "twice")


def test_the_engine_frees_cublas_workspaces_before_giving_memory_back_and_captures_make_their_own(monkeypatch):
    """A cuBLAS workspace made inside a large cached segment keeps the whole segment from the driver (the update's
    backward made one inside the sleeping engine's cached KV cache on an H200: 62 GiB held): the engine frees the
    workspaces (after dropping its graphs) before it empties the cache, and a capture clears them before and after,
    so that its graph's own workspace is in the graphs' pool and none outside it is replayed into."""
    from types import SimpleNamespace
    from lathe import device as accel
    from lathe.engine.llm_engine import LatheEngine
    calls = []
    monkeypatch.setattr(accel, "clear_blas_workspaces", lambda device: calls.append("clear"))
    monkeypatch.setattr(accel, "empty_cache", lambda device: calls.append("empty"))
    engine = SimpleNamespace(runner=SimpleNamespace(graphs=SimpleNamespace(reset=lambda: calls.append("reset"))),
                             model=SimpleNamespace(device=torch.device("cpu")), states=None, drafter=None,
                             kv_cache=SimpleNamespace(fixed_address=False), tp=SimpleNamespace(min_int=int))
    LatheEngine._release_memory(engine)
    assert calls == ["reset", "clear", "empty"]
    calls.clear()
    monkeypatch.setattr(accel, "synchronize", lambda device: None)
    monkeypatch.setattr(accel, "new_graph", lambda device: "graph")
    monkeypatch.setattr(accel, "graph_pool", lambda device: "pool")

    class Capture:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            calls.append("capture")

        def __exit__(self, *exc):
            calls.append("captured")
    monkeypatch.setattr(accel, "capture", Capture)
    graphs = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu")), pool=None, graphs={}, outputs={},
                             captures=0, capture_seconds=0.0, _warm_up=lambda key: calls.append("warm"),
                             _forward=lambda key: "out")
    DecodeGraphs._capture_once(graphs, "k")
    assert calls == ["warm", "clear", "capture", "captured", "clear"] and graphs.graphs == {"k": "graph"}
