"""Data-parallel attention (`lathe.engine.data_parallel`): an engine of D replicas of T gloo ranks, the experts over
all D x T ranks, each replica generating its own share of the prompts, samples token for token what one process
samples for the whole batch (greedy, sampled, after new weights), also while one replica has finished or has nothing
to do, and a prompt one replica refuses stops them all; the experts' slices recombine to the whole weights."""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.conftest import PROMPTS
from helpers import free_port, gloo_rank, run_processes
from lathe.engine import expert_parallel
from lathe.engine.data_parallel import engine_groups
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import AttentionDataParallel, ShardLayout, TensorParallel, check_replica, shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from models.lathe_tiny import save_hf

JOIN_S = 120
MORE = PROMPTS + [[3, 1, 4, 1, 5], [9, 2, 6]]
# each call: (samples per prompt, temperature, each replica's prompts) — replica 1 runs out first, then has none
CALLS = ((2, 0.0, 4), (3, 1.0, 5), (2, 0.0, 6))


def shares(replica: int, replicas: int, first: int) -> tuple[int, int]:
    """(start, end) of the prompts `replica` generates: replica 0 takes `first`, the others split the rest."""
    if replica == 0:
        return 0, first
    rest = len(MORE) - first
    per = -(-rest // (replicas - 1))
    start = first + (replica - 1) * per
    return min(start, len(MORE)), min(start + per, len(MORE))


def new_weights(path: str):
    whole = load_lathe_model(path, torch.float32)
    for name, t in whole.state_dict().items():
        yield name, t * 1.1 if t.dim() == 2 else t + 0.05


def generations(model, path: str, replica: int | None = None, replicas: int = 1) -> list[list[list[int]]]:
    """The three `CALLS` (the last after new weights): replica `replica`'s share, or every prompt (None)."""
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48,
                         record_routing=True)        # (routing replay's record: an idle replica records none)
    out = []
    for i, (n, temperature, first) in enumerate(CALLS):
        if i == 2:
            engine.update_weights(new_weights(path))
        start, end = shares(replica, replicas, first) if replica is not None else (0, len(MORE))
        params = SamplingParams(n=n, temperature=temperature, top_p=0.9, max_tokens=10 if i else 12, seed=3)
        out.append(engine.generate(MORE[start:end], params, first_index=start * n).token_ids)
    if replica is not None:         # a prompt one replica cannot take: every replica stops, none waits for it
        try:
            engine.generate([[1] * 60] if replica == 0 else MORE[:1], SamplingParams(max_tokens=4))
        except Exception as e:
            out.append(str(e))
    return out


def whole_share(want: list, replica: int, replicas: int) -> list:
    """One process's samples of what `replica` generates."""
    return [w[shares(replica, replicas, first)[0] * n:shares(replica, replicas, first)[1] * n]
            for w, (n, _, first) in zip(want, CALLS)]


def worker(rank: int, world: int, tp_size: int, port: int, paths: list[str], queue, gather_bytes: int) -> None:
    try:
        torch.set_num_threads(1)
        expert_parallel.GATHER_BYTES = gather_bytes
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=JOIN_S))
        dp_size = world // tp_size
        tp, dp = engine_groups(tp_size, dp_size)
        out = []
        for path in paths:
            whole = load_lathe_model(path, torch.float32)
            model = shard_copy(whole, torch.float32, torch.device("cpu"), tp, expert_parallel_size=world, dp=dp)
            out.append((dp.rank, generations(model, path, dp.rank, dp_size)))
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_engine(world: int, tp_size: int, paths: list[str], gather_bytes: int) -> dict[int, list]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, tp_size, port, paths, queue, gather_bytes), daemon=True)
             for r in range(world)]
    return run_processes(procs, queue, 3 * JOIN_S)


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    """Qwen3-MoE, Qwen3.5-MoE (shared expert, linear attention), GPT-OSS (expert biases, sinks), DeepSeek-V3 (latent
    attention, grouped routing, a shared expert), Nemotron-H (Mamba2, non-gated experts between latent projections)."""
    from models.deepseek_tiny import deepseek_model
    from models.gpt_oss_tiny import gpt_oss_model
    from models.nemotron_tiny import nemotron_model
    root = tmp_path_factory.mktemp("dp-ckpt")
    paths = [str(save_hf(root, family)[0]) for family in ("qwen3_moe", "qwen3_5_moe_text")]
    for name, make in (("gpt_oss", gpt_oss_model), ("deepseek", deepseek_model),
                       ("nemotron", lambda seed: nemotron_model(seed=seed, moe_latent_size=16))):
        make(seed=2).save_pretrained(root / name)
        paths.append(str(root / name))
    return paths


def assert_as_one_process(results: dict[int, list], paths: list[str], replicas: int, label: str) -> None:
    want = [generations(load_lathe_model(p, torch.float32), p) for p in paths]
    for rank, got in results.items():
        for path, w, (replica, g) in zip(paths, want, got):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g,
                                  whole_share(w, replica, replicas)):
                assert a == b, f"{label}, rank {rank} (replica {replica}), {path}: {what} tokens differ"
            assert len(g) == 4 and ("max_model_len" in g[3] if replica == 0 else "another replica" in g[3]), g[3:]


@pytest.mark.parametrize("tp_size", [1, 2], ids=["dp2", "dp2xtp2"])
def test_an_engine_of_replicas_samples_what_one_process_samples(moe_paths, tp_size):
    """D=2 replicas of 1 rank (each with half the experts), then of 2 ranks (a quarter each: the experts gathered
    over the replicas, summed over the replica's ranks); the first with the tokens gathered a few at a time."""
    paths = moe_paths if tp_size == 1 else moe_paths[::3]         # (4 ranks on 2 cores: Qwen3-MoE and DeepSeek)
    gather_bytes = 8 * 2 * 32 * 4 if tp_size == 1 else expert_parallel.GATHER_BYTES   # (4 tokens of 32 fp32 at k=2)
    assert_as_one_process(run_engine(2 * tp_size, tp_size, paths, gather_bytes), paths, 2, f"DP 2 x TP {tp_size}")


def test_the_experts_are_spread_over_the_engine(moe_paths):
    """Engine rank d T + t holds the (d T + t)-th share of every layer's experts; everything else is its replica's
    position's slice."""
    whole = load_lathe_model(moe_paths[0], torch.float32)
    state = whole.state_dict()
    name = next(n for n in state if n.endswith("experts.gate_up_proj"))
    parts = {(d, t): dict(ShardLayout(whole.config, TensorParallel(None, t, 2), 4,
                                      dp=AttentionDataParallel(None, d, 2)).local_items(state.items()))
             for d in (0, 1) for t in (0, 1)}
    assert torch.equal(torch.cat([parts[d, t][name] for d in (0, 1) for t in (0, 1)]), state[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(parts[0, 1][q], parts[1, 1][q]) and not torch.equal(parts[0, 0][q], parts[0, 1][q])


def test_sizes_that_do_not_fit_are_refused(moe_paths, tmp_path):
    whole = load_lathe_model(moe_paths[0], torch.float32)
    with pytest.raises(ValueError, match="expert_parallel_size=4"):
        check_replica(whole, 2, 2, data_parallel_size=2)
    with pytest.raises(ValueError, match="divides 4"):
        check_replica(whole, 1, 8, data_parallel_size=8)
    dense = load_lathe_model(str(save_hf(tmp_path, "qwen3")[0]), torch.float32)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        check_replica(dense, 1, 2, data_parallel_size=2)


def test_fp8_rollout_is_refused_with_data_parallel_attention(moe_paths):
    """Not built together (nor with tensor-parallel replicas): refused when the engine is made, naming both."""
    whole = load_lathe_model(moe_paths[0], torch.float32)
    replica = shard_copy(whole, torch.float32, torch.device("cpu"), TensorParallel(None, 0, 1),
                         expert_parallel_size=2, dp=AttentionDataParallel(None, 0, 2))
    with pytest.raises(ValueError, match="quantization='fp8': not implemented for data-parallel attention"):
        LatheEngine(replica, eos_token_id=None, block_size=4, num_kv_blocks=8, max_model_len=48, quantization="fp8")


def static_worker(rank: int, world: int, port: int, paths: list[str], queue) -> None:
    """Each family's sparse layers' experts on D=`world` replicas of 1 rank: the decode graph's path
    (`_across_replicas_static`) against the eager one, on the same rows: in float32 with the rows of this rank's
    experts counted on the host, and in bfloat16 as a graph runs it (`STATIC_ROWS`; torch's grouped matmul, which has
    a CPU form: the rows past its last offset left as they come, a bias looked up for them clamped)."""
    from lathe.models import moe
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=JOIN_S))
        tp, dp = engine_groups(1, world)
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            graph_form = dtype == torch.bfloat16
            moe.grouped_mm_supported = (lambda *args: True) if graph_form else moe.grouped_mm_supported
            expert_parallel.STATIC_ROWS = graph_form
            for path in paths:
                model = shard_copy(load_lathe_model(path, dtype), dtype, torch.device("cpu"), tp,
                                   expert_parallel_size=world, dp=dp)
                gen = torch.Generator().manual_seed(rank)
                for block in moe.sparse_blocks(model):
                    experts, k = block.experts, block.moe.num_experts_per_tok
                    x = torch.randn(5, block.moe_hidden, generator=gen).to(dtype)
                    chosen = torch.stack([torch.randperm(block.moe.num_experts, generator=gen)[:k]
                                          for _ in range(5)])
                    with torch.inference_mode():
                        static = experts._across_replicas_static(x, chosen)
                        expert_parallel.STATIC_ROWS = False
                        eager = experts._across_replicas(x, chosen)
                        expert_parallel.STATIC_ROWS = graph_form
                    out.append((str(dtype), path.rsplit("/", 1)[-1],
                                torch.equal(eager, static) and eager.abs().sum().item() > 0))
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_decode_graphs_experts_path_equals_the_eager_one(moe_paths):
    """The experts' path a data-parallel-attention engine's decode graph records (the bucket's rows in one piece,
    rows sorted with other ranks' experts keyed last, their outputs zeroed) computes what the eager path does, bit for
    bit: the same rows reach the same experts in the same order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=static_worker, args=(r, 2, port, moe_paths, queue), daemon=True) for r in range(2)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    for rank, out in results.items():
        assert not isinstance(out, str), out
        assert out and all(ok for *_, ok in out), (rank, out)


def one_empty_step(engine: LatheEngine) -> None:
    """`engine`'s third scheduled step has no sequence (its state untouched: they run at the next)."""
    schedule, calls = engine.scheduler.schedule, []

    def one_empty():
        calls.append(1)
        return ([], False, []) if len(calls) == 3 else schedule()
    engine.scheduler.schedule = one_empty


def empty_step_share(rank: int, world: int, path: str) -> tuple[int, list]:
    """Replica `rank` of `world`, its share of `MORE`, sampled: (its first prompt, its tokens); replica 0's scheduler
    yields one decode step with no sequences (as when its only running sequences are preempted), which it must idle
    through."""
    tp, dp = engine_groups(1, world)
    model = shard_copy(load_lathe_model(path, torch.float32), torch.float32, torch.device("cpu"), tp,
                       expert_parallel_size=world, dp=dp)
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48)
    if rank == 0:
        one_empty_step(engine)
    start, end = shares(rank, world, 4)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, seed=3)
    return start, engine.generate(MORE[start:end], params, first_index=start * 2).token_ids


def empty_step_worker(rank: int, world: int, port: int, path: str, queue) -> None:
    gloo_rank(rank, world, port, queue, lambda: empty_step_share(rank, world, path), JOIN_S)


def test_a_replica_whose_step_schedules_nothing_idles_through_it(moe_paths):
    """A decode step that schedules no sequence on one replica (all its running ones preempted) still takes part in
    the other replica's collectives: both sample what one process samples (which such a step had crashed on, with no
    sequence to take a block table's width from)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=empty_step_worker, args=(r, 2, port, moe_paths[0], queue), daemon=True)
             for r in range(2)]
    results = run_processes(procs, queue, 3 * JOIN_S)
    engine = LatheEngine(load_lathe_model(moe_paths[0], torch.float32), eos_token_id=None, block_size=4,
                         num_kv_blocks=64, max_model_len=48)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, seed=3)
    want = engine.generate(MORE, params).token_ids
    one_empty_step(engine)                                  # one process too
    assert engine.generate(MORE, params).token_ids == want
    for rank, out in results.items():
        assert not isinstance(out, str), out
        start, got = out
        assert got == want[2 * start:2 * start + len(got)] and got, rank
