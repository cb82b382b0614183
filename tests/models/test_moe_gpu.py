"""Qwen3-MoE's CUDA path: the grouped matmul (bf16, Hopper) against the expert loop, forward and backward; a sparse
layer captured in a CUDA graph; the engine with its decode graphs on a tiny MoE checkpoint."""

import pytest
import torch

from lathe.models.config import LatheConfig
from lathe.models.moe import SparseMoeBlock, experts_forward, graph_capturable, grouped_mm_supported

from helpers import assert_close_rel

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _needs_grouped():
    if not grouped_mm_supported(CUDA, torch.bfloat16, 256, 128):
        pytest.skip("torch._grouped_mm in bf16 needs compute capability 9.0 and a torch that has it")


def _block(experts=16, top_k=4, hidden=256, inter=128) -> SparseMoeBlock:
    cfg = LatheConfig.from_hf_dict({"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": hidden,
                                    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "num_experts": experts, "num_experts_per_tok": top_k,
                                    "moe_intermediate_size": inter, "norm_topk_prob": True})
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block.to(CUDA, torch.bfloat16)


def test_grouped_matmul_equals_the_loop_forward_and_backward():
    _needs_grouped()
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, t, k = 16, 256, 128, 300, 4
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    down = (torch.randn(e, h, i, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16().requires_grad_()
    chosen = torch.randint(0, e - 1, (t, k), device="cuda", generator=g)            # the last expert gets nothing
    weights = torch.rand(t, k, device="cuda", generator=g).bfloat16()
    out = experts_forward(x, weights, chosen, gate_up, down)                        # grouped: bf16 on Hopper
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [x.detach().float().requires_grad_(), gate_up.detach().float().requires_grad_(),
              down.detach().float().requires_grad_()]
    ref = experts_forward(leaves[0], weights.float(), chosen, leaves[1], leaves[2])    # the loop, fp32
    ref.backward(grad.float())
    assert_close_rel(out.float(), ref, rel=2e-2, name="grouped experts")
    for name, a, b in zip(("x", "gate_up_proj", "down_proj"), (x, gate_up, down), leaves):
        assert_close_rel(a.grad.float(), b.grad, rel=3e-2, name=f"grad of {name}")
    assert gate_up.grad[e - 1].abs().sum() == 0


def test_a_sparse_layer_replays_in_a_cuda_graph():
    _needs_grouped()
    block = _block()
    assert graph_capturable(block)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        block(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        for seed in range(3):
            x.copy_(torch.randn(64, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, block(x))          # deterministic: no atomic adds


def test_engine_decode_graphs_on_a_moe_checkpoint(tmp_path):
    """bf16: the engine captures its decode graphs and its log-probs are the fp32 model's teacher-forced ones; fp32:
    no grouped matmul, so the engine decodes eagerly and gives transformers' greedy tokens."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from models.lathe_tiny import MOE, save_hf

    from engine.conftest import PROMPTS
    from engine.test_llm_engine import _hf_greedy
    path, hf = save_hf(tmp_path, MOE)
    engine = LatheEngine.from_pretrained(path, dtype=torch.bfloat16, device="cuda", eos_token_id=None,
                                         block_size=4, num_kv_blocks=128)
    assert engine.runner.graphs is not None
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    model = load_lathe_model(path, torch.float32, device="cuda")
    for prompt, ids, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1:-1].double()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids, device="cuda")[:, None]).squeeze(-1).cpu()
        assert_close_rel(torch.tensor(lps), ref, rel=5e-2, name="bf16 engine log-probs")
    eager = LatheEngine.from_pretrained(path, dtype=torch.float32, device="cuda", eos_token_id=None, block_size=4,
                                        num_kv_blocks=128)
    assert eager.runner.graphs is None
    out = eager.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert out.token_ids == [_hf_greedy(hf, p, 8) for p in PROMPTS]
