"""Expert-parallel MoE layers in tensor-parallel engine replicas (`lathe.engine.expert_parallel`): each rank's
experts' partial outputs sum to the whole layer's (eager and graph-capture row selection), and a TP=2 replica of a
tiny Qwen3-MoE and a tiny GPT-OSS over gloo generates what one process generates, token for token, with the same
log-probs and the same recorded routing, before and after a weight update."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from engine.conftest import PROMPTS
from engine.test_tensor_parallel import run_replica
from helpers import assert_close_rel
from lathe.engine import expert_parallel
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import ShardLayout, TensorParallel, shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from lathe.models.moe import route, sorted_forward, sparse_blocks, split_expert_weights
from models.gpt_oss_tiny import gpt_oss_model
from models.lathe_tiny import MOE, save_hf


def generations(model, path: str) -> list[tuple]:
    """(tokens, log-probs, routed experts) of greedy, sampled, and greedy again after new weights."""
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48,
                         record_routing=True)
    runs = []
    for params in (SamplingParams(n=2, temperature=0, max_tokens=8),
                   SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, seed=3)):
        runs.append(engine.generate(PROMPTS, params))
    engine.update_weights(new_weights(path))
    runs.append(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=8)))
    return [(r.token_ids, r.logprobs, [e.tolist() for e in r.routed_experts]) for r in runs]   # plain data: queued


def new_weights(path: str):
    """Whole weights under their module names (fused experts), changed: what a trainer's update sends."""
    for name, t in load_lathe_model(path, torch.float32).state_dict().items():
        yield name, t * 1.1 if t.dim() == 2 else t + 0.05


def build(path: str, tp: TensorParallel | None, device: torch.device = torch.device("cpu")):
    model = load_lathe_model(path, torch.float32, device=device)
    if tp is None:
        return model
    # the Hub's per-expert names (Qwen3-MoE's checkpoints) for one family, the fused module names for the other
    state = split_expert_weights(model.state_dict()).items() if "qwen3" in path else None
    return shard_copy(model, torch.float32, device, tp, state=state, expert_parallel_size=tp.size)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-ckpt")
    oss = root / "gpt-oss"
    gpt_oss_model(seed=2).save_pretrained(oss)
    return [str(save_hf(root, MOE)[0]), str(oss)]


def test_a_replica_of_two_generates_what_one_process_generates(paths, device_type="cpu"):
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    want = [generations(build(p, None, device), p) for p in paths]
    for rank, got in run_replica(2, paths, device_type, build, generations).items():
        for path, g_runs, w_runs in zip(paths, got, want):
            for what, (tokens, lps, routed), (w_tokens, w_lps, w_routed) in zip(
                    ("greedy", "sampled", "greedy after new weights"), g_runs, w_runs):
                where = f"rank {rank}, {path.rsplit('/', 1)[-1]}, {what}"
                assert tokens == w_tokens, f"{where}: tokens differ"
                assert_close_rel(torch.tensor(sum(lps, [])), torch.tensor(sum(w_lps, [])), rel=1e-5,
                                 name=f"{where}: log-probs")
                assert routed == w_routed, f"{where}: routing differs"
                assert all(min(min(map(min, r[:-1]))) >= 0 for r in routed)      # every fed token routed


@pytest.mark.gpu
def test_a_replica_over_two_gpus_generates_what_one_gpu_generates(paths):
    """NCCL and compiled layers in float32 (the experts' loop: no CUDA graphs; bf16 grouped matmuls would capture)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    test_a_replica_of_two_generates_what_one_process_generates(paths, "cuda")


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs `torch._grouped_mm` on the CPU in float32 (2.13 does), to run the grouped path here."""
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_ranks_experts_sum_to_the_whole_layer(family, grouped):
    """Each rank's `LocalExperts` (eager: only its rows; under a graph capture: every row, others masked) over the
    same sorted rows, with the experts' loop (float64) or their grouped matmuls (float32); the partial outputs of 4
    ranks, one expert each, sum to the whole layer's."""
    from lathe.models import moe
    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hf_model
    if grouped and not _cpu_grouped_mm():
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    dtype, rel = (torch.float32, 1e-5) if grouped else (torch.float64, 1e-12)
    model = lathe_from_transformers(hf_model(MOE) if family == MOE else gpt_oss_model(seed=2)).eval().to(dtype)
    prefix = f"model.layers.{1 if family == MOE else 0}.mlp.experts."        # Qwen3-MoE's layer 0 is dense
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, model.config.hidden_size, generator=g, dtype=dtype)
    weights, chosen = route(torch.softmax(torch.randn(9, 4, generator=g), -1), 2, True)
    with mock.patch.object(moe, "grouped_mm_supported", lambda *a: grouped):
        want = sorted_forward(x, weights.to(dtype), chosen, sparse_blocks(model)[0].experts)
        for capturing in (False, True):
            total = torch.zeros_like(want)
            for rank in range(4):
                tp = TensorParallel(None, rank, 4)
                layout = ShardLayout(model.config, tp, 4)
                state = dict(layout.local_items(model.state_dict().items()))
                local = copy.deepcopy(model)
                layout.experts.place(local, tp)
                experts = sparse_blocks(local)[0].experts
                for name, _ in list(experts.named_parameters()):
                    experts.register_parameter(name, torch.nn.Parameter(state[prefix + name]))
                assert experts.gate_up_proj.shape[0] == 1
                with mock.patch.object(expert_parallel, "capturing", lambda device: capturing):
                    total += sorted_forward(x, weights.to(dtype), chosen, experts)
            assert_close_rel(total, want, rel=rel, name=f"{family}, grouped={grouped}, capturing={capturing}")


def test_sizes_are_checked(caplog):
    """A MoE model in a replica needs rollout.expert_parallel_size = the replica's size (1, vLLM's tensor-parallel
    experts, places them the same way, with a notice) and whole experts per rank; a dense model takes no
    expert-parallel size."""
    from lathe.models.config import LatheConfig
    from models.lathe_tiny import hf_config
    moe = LatheConfig.from_hf_dict(hf_config(MOE).to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 with rollout.expert_parallel_size=2: "
                                         r"Qwen3MoeForCausalLM is a mixture-of-experts .* Fix: set "
                                         r"rollout.expert_parallel_size=4"):
        ShardLayout(moe, TensorParallel(None, 0, 4), 2)
    with caplog.at_level("INFO", logger="lathe"):
        ShardLayout(moe, TensorParallel(None, 0, 2), 1)
    assert "experts run expert-parallel over each replica's 2 ranks" in caplog.text
    with pytest.raises(ValueError, match=r"num_experts / 8 whole experts, and Qwen3MoeForCausalLM has 4"):
        ShardLayout(moe, TensorParallel(None, 0, 8), 8)
    dense = LatheConfig.from_hf_dict(hf_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match="expert_parallel_size=2: Qwen3ForCausalLM has no mixture-of-experts"):
        ShardLayout(dense, TensorParallel(None, 0, 2), 2)


def test_a_replica_is_checked_before_any_process_group_exists():
    """`check_replica`, which `lathe train` runs before its workers start: the sizes (a hybrid's linear-attention key
    heads among them)."""
    from lathe.engine.tensor_parallel import check_replica
    from lathe.models.config import LatheConfig
    from lathe.models.decoder import LatheCausalLM
    from models.lathe_tiny import hf_config, hybrid_config
    with torch.device("meta"):
        moe = LatheCausalLM(LatheConfig.from_hf_dict(hf_config(MOE).to_dict()
                                                     | {"architectures": ["Qwen3MoeForCausalLM"]}))
        hybrid = LatheCausalLM(LatheConfig.from_hf_dict(hybrid_config("qwen3_5_text").to_dict()
                                                        | {"architectures": ["Qwen3_5ForCausalLM"]}))
    check_replica(moe, 2, 2)
    check_replica(moe, 2, 1)                  # vLLM's tensor-parallel experts: placed whole, as with 2
    with pytest.raises(ValueError, match="Fix: set rollout.expert_parallel_size=4"):
        check_replica(moe, 4, 2)
    check_replica(hybrid, 2)                  # 2 linear-attention key heads: 1 a rank
    with pytest.raises(ValueError, match="the linear-attention key heads \\(2\\) are not divisible by it"):
        check_replica(hybrid, 4)
