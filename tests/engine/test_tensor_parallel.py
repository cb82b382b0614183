"""Tensor-parallel engine replicas (`lathe.engine.tensor_parallel`): the slices recombine to the whole weights, and
a replica over 2 and 4 gloo ranks generates what one process generates, token for token, before and after a
weight update."""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.conftest import PROMPTS
from helpers import free_port, run_processes
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import ShardLayout, TensorParallel, replica_groups, shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from models.lathe_tiny import save_hf

JOIN_S = 120
CASES = (("qwen2", False), ("llama", True), ("qwen3", False))     # (family, tied embeddings)


def generations(model, path: str) -> list[list[list[int]]]:
    """Greedy, sampled, and greedy again after new weights (each weight scaled, the norms shifted)."""
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48)
    out = [engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=10)).token_ids,
           engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=3)).token_ids]
    engine.update_weights(new_weights(path))
    out.append(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=10)).token_ids)
    return out


def new_weights(path: str, load=None):
    """Whole weights, changed: what a trainer's update sends. `load`: how to load `path` (lathe's decoder in float32
    by default)."""
    whole = load(path) if load is not None else load_lathe_model(path, torch.float32)
    for name, t in whole.state_dict().items():
        yield name, t * 1.1 if t.dim() == 2 else t + 0.05


def build(path, tp: TensorParallel | None, device: torch.device = torch.device("cpu")):
    model = load_lathe_model(path, torch.float32, device=device)
    if tp is not None:
        model = shard_copy(model, torch.float32, device, tp)
    return model


def worker(rank: int, world: int, port: int, paths: list[str], queue, device_type: str = "cpu", make=None,
           generate=None) -> None:
    """Rank `rank` of a replica: `generate(make(path, tp, device), path)` per path (by default this module's
    `build` and `generations`) to the queue."""
    make, generate = make or build, generate or generations
    try:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        if device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=JOIN_S))
        tp = replica_groups(world)
        queue.put((rank, [generate(make(p, tp, device), p) for p in paths]))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_replica(world: int, paths: list[str], device_type: str = "cpu", make=None, generate=None) -> dict[int, list]:
    """Each rank's `worker` results, the ranks forks of one forkserver (it imports torch, lathe and the modules of
    `make`/`generate` once)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(sorted({__name__, *(f.__module__ for f in (make, generate) if f is not None)}))
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, paths, queue, device_type, make, generate), daemon=True)
             for r in range(world)]
    return run_processes(procs, queue, 3 * JOIN_S)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-ckpt")
    return [str(save_hf(root, family, tie=tie)[0]) for family, tie in CASES]


@pytest.mark.parametrize("size", [2, 4])
def test_slices_recombine_to_the_whole_weights(paths, size):
    whole = load_lathe_model(paths[1], torch.float32)          # llama, tied: the LM head comes from the embeddings
    state = whole.state_dict()
    parts = [dict(ShardLayout(whole.config, TensorParallel(None, r, size)).local_items(state.items()))
             for r in range(size)]
    layer = "model.layers.0."
    assert torch.equal(torch.cat([p[layer + "self_attn.q_proj.weight"] for p in parts]),
                       state[layer + "self_attn.q_proj.weight"])
    assert torch.equal(torch.cat([p[layer + "self_attn.o_proj.weight"] for p in parts], 1),
                       state[layer + "self_attn.o_proj.weight"])
    assert torch.equal(torch.cat([p[layer + "mlp.down_proj.weight"] for p in parts], 1),
                       state[layer + "mlp.down_proj.weight"])
    head = torch.cat([p["lm_head.weight"] for p in parts])
    assert torch.equal(head[:whole.config.vocab_size], state["model.embed_tokens.weight"])
    assert not head[whole.config.vocab_size:].any()                       # the padding rows of the last slice
    kv = [p[layer + "self_attn.k_proj.weight"] for p in parts]            # 2 kv heads: whole or replicated
    d, hidden = whole.config.head_dim, whole.config.hidden_size
    heads = [k.view(-1, d, hidden) for k in kv]
    for r in range(size):                         # each rank's kv heads are those its query heads use
        q_heads = range(r * 4 // size, (r + 1) * 4 // size)
        used = sorted({h // 2 for h in q_heads})
        assert torch.equal(heads[r], state[layer + "self_attn.k_proj.weight"].view(-1, d, hidden)[used])


def test_a_size_that_does_not_divide_the_heads_is_refused(paths):
    cfg = load_lathe_model(paths[0], torch.float32).config
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3: the attention heads"):
        ShardLayout(cfg, TensorParallel(None, 0, 3))


def test_one_process_cannot_hold_a_replica_of_two():
    with pytest.raises(RuntimeError, match="tensor_model_parallel_size=2"):
        replica_groups(2)


def assert_same_generations(results: dict[int, list], want: list, world: int) -> None:
    for rank, got in results.items():
        for case, (g, w) in enumerate(zip(got, want)):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g, w):
                assert a == b, f"rank {rank} of {world}, {CASES[case]}: {what} tokens differ"


@pytest.mark.parametrize("world", [2, 4])
def test_a_replica_generates_what_one_process_generates(paths, world):
    want = [generations(build(p, None), p) for p in paths]
    assert_same_generations(run_replica(world, paths if world == 2 else paths[:1]), want, world)


@pytest.mark.gpu
def test_a_replica_over_two_gpus_generates_what_one_gpu_generates(paths):
    """NCCL, CUDA graphs (the all-reduces and the LM head's gather captured) and compiled layers, in float32; one
    family (Qwen2's: what the GPU adds does not depend on the family, the CPU test covers the three), since each
    engine compiles its layers and captures its graphs, in one process and in each rank: with the three families
    the test did not finish within 430 s on 2 cold H200s (2026-12-01)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    want = [generations(build(paths[0], None, torch.device("cuda", 0)), paths[0])]
    assert_same_generations(run_replica(2, paths[:1], "cuda"), want, 2)


def test_a_mimo_replica_leaves_the_mtp_layers_out(tmp_path):
    from models.mimo_tiny import save_mimo
    model = load_lathe_model(save_mimo(tmp_path / "mimo")[0])
    tp = TensorParallel(None, 0, 2)
    replica = shard_copy(model, torch.float32, torch.device("cpu"), tp)
    assert not hasattr(replica.model, "mtp_layers")
    assert not any(n.startswith("model.mtp_layers.") for n, _ in replica.tensor_parallel.local_items(
        model.state_dict().items()))
    kept = shard_copy(model, torch.float32, torch.device("cpu"), tp, keep_mtp=True)     # speculative decoding
    whole = {n: t for n, t in model.state_dict().items() if n.startswith("model.mtp_layers.")}
    assert {n: t for n, t in kept.state_dict().items() if n.startswith("model.mtp_layers.")}.keys() == whole.keys()
    assert all(torch.equal(kept.state_dict()[n], t) for n, t in whole.items())
    assert dict(kept.tensor_parallel.local_items(whole.items())).keys() == whole.keys()


# -- the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): linear attention, gated attention, shared experts --------
HYBRID_CASES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


@pytest.fixture(scope="module")
def hybrid_paths(tmp_path_factory):
    from models.lathe_tiny import HYBRIDS
    assert set(HYBRID_CASES) == set(HYBRIDS)
    root = tmp_path_factory.mktemp("tp-hybrid")
    return [str(save_hf(root, family)[0]) for family in HYBRID_CASES]


def build_expert_parallel(path, tp: TensorParallel | None, device: torch.device = torch.device("cpu")):
    """`build`, a MoE model's experts placed over the replica (`rollout.expert_parallel_size` = its size)."""
    model = load_lathe_model(path, torch.float32, device=device)
    if tp is not None:
        ep = tp.size if model.config.moe is not None else 1
        model = shard_copy(model, torch.float32, device, tp, expert_parallel_size=ep)
    return model


@pytest.mark.parametrize("size", [2, 4])
def test_hybrid_slices_recombine_to_the_whole_weights(hybrid_paths, size):
    """Each rank's key heads with their value heads (linear attention: the q, k, v sections of the projection and the
    convolution, z, b, a, A_log, dt_bias; Qwen3-Next's groups per key head), the gated attention's query and gate rows
    per head, the shared expert's features: the ranks' slices, joined, are the whole tensors."""
    for path in hybrid_paths:
        whole = load_lathe_model(path, torch.float32)
        la, state = whole.config.linear_attention, whole.state_dict()
        if la.num_key_heads % size:
            with pytest.raises(ValueError, match="linear-attention key heads"):
                ShardLayout(whole.config, TensorParallel(None, 0, size), size if whole.config.moe else 1)
            continue
        parts = [dict(ShardLayout(whole.config, TensorParallel(None, r, size), size if whole.config.moe else 1)
                      .local_items(state.items())) for r in range(size)]
        hk, dk, dv, r = la.num_key_heads, la.key_head_dim, la.value_head_dim, la.num_value_heads // la.num_key_heads

        def joined(name, dim=0, sections=None):
            if sections is None:
                return torch.cat([p[name] for p in parts], dim)
            cuts = [p[name].split(sections(p), dim) for p in parts]
            return torch.cat([torch.cat([c[i] for c in cuts], dim) for i in range(3)], dim)
        lin = "model.layers.0.linear_attn."
        mine = lambda p: [hk // size * dk, hk // size * dk, hk // size * r * dv]       # noqa: E731
        names = [n for n in state if n.startswith(lin)]
        for name in names:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                assert torch.equal(joined(name, sections=mine), state[name]), name
            elif name.endswith("out_proj.weight"):
                assert torch.equal(joined(name, 1), state[name]), name
            elif name.endswith("norm.weight"):
                assert all(torch.equal(p[name], state[name]) for p in parts), name
            else:
                assert torch.equal(joined(name), state[name]), name
        attn = "model.layers.1.self_attn."
        assert torch.equal(joined(attn + "q_proj.weight"), state[attn + "q_proj.weight"])
        assert torch.equal(joined(attn + "o_proj.weight", 1), state[attn + "o_proj.weight"])
        shared = "model.layers.1.mlp.shared_expert."
        if shared + "down_proj.weight" in state:
            assert torch.equal(joined(shared + "gate_proj.weight"), state[shared + "gate_proj.weight"])
            assert torch.equal(joined(shared + "down_proj.weight", 1), state[shared + "down_proj.weight"])
            assert all(torch.equal(p["model.layers.1.mlp.shared_expert_gate.weight"],
                                   state["model.layers.1.mlp.shared_expert_gate.weight"]) for p in parts)


def test_a_hybrid_replica_generates_what_one_process_generates(hybrid_paths):
    """Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next (shared experts beside the routed ones, placed over the replica)
    over 2 gloo ranks: the linear-attention states of each rank's heads, the gated attention's heads, greedy and
    sampled, before and after new weights: token for token what one process generates."""
    want = [generations(build_expert_parallel(p, None), p) for p in hybrid_paths]
    results = run_replica(2, hybrid_paths, make=build_expert_parallel)
    for rank, got in results.items():
        for case, (g, w) in enumerate(zip(got, want)):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g, w):
                assert a == b, f"rank {rank} of 2, {HYBRID_CASES[case]}: {what} tokens differ"


def test_a_deepseek_replica_generates_what_one_process_generates(tmp_path):
    """DeepSeek-V3's latent attention over 2 gloo ranks (each rank its heads' query and kv_b_proj rows and o_proj
    columns, the low-rank down-projections whole), its dense first layer, its routed experts placed over the replica
    and its shared expert cut like a dense MLP: greedy and sampled, before and after new weights, token for token
    what one process generates; the slices recombine to the whole weights."""
    from models.deepseek_tiny import deepseek_model
    path = tmp_path / "deepseek"
    deepseek_model(seed=2).save_pretrained(path)
    whole = load_lathe_model(str(path), torch.float32)
    state = whole.state_dict()
    parts = [dict(ShardLayout(whole.config, TensorParallel(None, r, 2), 2).local_items(state.items())) for r in (0, 1)]
    for name, dim in (("model.layers.0.self_attn.q_b_proj.weight", 0), ("model.layers.0.self_attn.kv_b_proj.weight", 0),
                      ("model.layers.0.self_attn.o_proj.weight", 1), ("model.layers.1.mlp.shared_experts.up_proj.weight", 0),
                      ("model.layers.1.mlp.shared_experts.down_proj.weight", 1), ("model.layers.0.mlp.down_proj.weight", 1)):
        assert torch.equal(torch.cat([p[name] for p in parts], dim), state[name]), name
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.1.mlp.gate.weight"):
        assert all(torch.equal(p[name], state[name]) for p in parts), name
    want = [generations(build_expert_parallel(str(path), None), str(path))]
    for rank, got in run_replica(2, [str(path)], make=build_expert_parallel).items():
        for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), got[0], want[0]):
            assert a == b, f"rank {rank} of 2: {what} tokens differ"


def test_a_nemotron_h_replica_generates_what_one_process_generates(tmp_path):
    """Nemotron-H over 2 gloo ranks (each rank its Mamba2 heads with their groups of B and C, and their states; its
    attention heads; its rows of the relu^2 MLP and of the shared expert; its half of the routed experts, between
    whole latent projections in the second model): greedy and sampled, before and after new weights, token for token
    what one process generates; the slices recombine to the whole weights; 4 ranks, more than the groups, are
    refused by name."""
    pytest.importorskip("transformers.models.nemotron_h")
    from models.nemotron_tiny import nemotron_model
    paths = []
    for latent in (None, 12):
        paths.append(str(tmp_path / f"nemotron{latent}"))
        nemotron_model(seed=7, moe_latent_size=latent).save_pretrained(paths[-1])
    whole = load_lathe_model(paths[0], torch.float32)
    state, m = whole.state_dict(), whole.config.nemotron.mamba
    parts = [dict(ShardLayout(whole.config, TensorParallel(None, r, 2), 2).local_items(state.items())) for r in (0, 1)]
    inner, bc = m.inner, m.n_groups * m.state_size
    sections = {"model.layers.0.mixer.in_proj.weight": [inner, inner, bc, bc, m.num_heads],
                "model.layers.0.mixer.conv1d.weight": [inner, bc, bc], "model.layers.0.mixer.conv1d.bias": [inner, bc, bc]}
    for name, sizes in sections.items():          # each section cut in two, the halves side by side per rank
        halves = [p[name].split([n // 2 for n in sizes]) for p in parts]
        joined = torch.cat([torch.cat([h[i] for h in halves]) for i in range(len(sizes))])
        assert torch.equal(joined, state[name]), name
    for name, dim in (("model.layers.0.mixer.out_proj.weight", 1), ("model.layers.0.mixer.A_log", 0),
                      ("model.layers.0.mixer.norm.weight", 0), ("model.layers.2.mixer.q_proj.weight", 0),
                      ("model.layers.2.mixer.o_proj.weight", 1), ("model.layers.3.mixer.up_proj.weight", 0),
                      ("model.layers.3.mixer.down_proj.weight", 1),
                      ("model.layers.1.mixer.shared_experts.up_proj.weight", 0),
                      ("model.layers.1.mixer.shared_experts.down_proj.weight", 1),
                      ("model.layers.1.mixer.experts.up_proj", 0)):
        assert torch.equal(torch.cat([p[name] for p in parts], dim), state[name]), name
    for name in ("model.layers.1.mixer.gate.weight", "model.layers.0.norm.weight"):
        assert all(torch.equal(p[name], state[name]) for p in parts), name
    with pytest.raises(ValueError, match=r"Mamba2 layers' groups \(2, n_groups\)"):
        ShardLayout(whole.config, TensorParallel(None, 0, 4), 4)
    want = [generations(build_expert_parallel(p, None), p) for p in paths]
    for rank, got in run_replica(2, paths, make=build_expert_parallel).items():
        for case, (g, w) in enumerate(zip(got, want)):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g, w):
                assert a == b, f"rank {rank} of 2, {paths[case]}: {what} tokens differ"


@pytest.mark.gpu
def test_hybrid_and_latent_replicas_over_two_gpus_generate_what_one_gpu_generates(hybrid_paths, tmp_path):
    """NCCL, float32: the hybrids (fla's kernels, the decode states in CUDA graphs) and DeepSeek-V3 (the latent cache,
    eager decode) as TP=2 replicas against one GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from models.deepseek_tiny import deepseek_model
    deepseek_model(seed=2).save_pretrained(tmp_path / "deepseek")
    paths = [*hybrid_paths, str(tmp_path / "deepseek")]
    want = [generations(build_expert_parallel(p, None, torch.device("cuda", 0)), p) for p in paths]
    for rank, got in run_replica(2, paths, "cuda", make=build_expert_parallel).items():
        for case, (g, w) in enumerate(zip(got, want)):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g, w):
                assert a == b, f"rank {rank} of 2, {paths[case]}: {what} tokens differ"
