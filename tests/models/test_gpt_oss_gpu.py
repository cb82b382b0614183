"""GPT-OSS's CUDA path (not run on the CPU machines): the MoE block's grouped matmul with the experts' biases and the
clamped SwiGLU against its expert loop, forward and backward; packed bf16 logits against transformers'; the engine
on CUDA (compiled layers, the PyTorch or Triton decode attention with sinks and windows, no decode graphs) against the
teacher-forced forward."""

import pytest
import torch
import transformers

from lathe.models.gpt_oss import GptOssMoeBlock
from lathe.models.hf import lathe_from_transformers
from lathe.models.moe import grouped_mm_supported

from helpers import assert_close_rel

from .gpt_oss_tiny import gpt_oss_model
from .moe_reference import assert_logits_equal_transformers

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
_TRANSFORMERS = tuple(int(p) for p in transformers.__version__.split(".")[:2])   # lathe matches 5.24 on the CPU


def test_grouped_matmul_equals_the_loop_with_biases(monkeypatch):
    if not grouped_mm_supported(CUDA, torch.bfloat16, 64, 32):
        pytest.skip("torch._grouped_mm in bf16 needs compute capability 9.0 and a torch that has it")
    hf = gpt_oss_model(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    block = lathe_from_transformers(hf).model.layers[0].mlp.to(CUDA, torch.bfloat16)
    assert isinstance(block, GptOssMoeBlock)
    x = torch.randn(37, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr("lathe.models.moe.grouped_mm_supported", lambda *a, g=grouped: g)
        block.zero_grad()
        x.grad = None
        out = block(x)
        out.float().pow(2).sum().backward()
        results.append({"out": out, "x": x.grad, **{n: p.grad for n, p in block.named_parameters()}})
    assert_close_rel(results[0], results[1], rel=2e-2, name="grouped vs loop")


@pytest.mark.xfail(_TRANSFORMERS < (5, 24),
                   reason="H200 image, 2026-11-29: 0.099 norm-relative against its transformers (5.17), also in fp32 "
                          "and against transformers' CPU path, while lathe on CUDA equals lathe on the CPU and lathe "
                          "equals transformers 5.24 to 1e-6 (CPU tests): the two transformers versions compute this "
                          "tiny GPT-OSS differently; which matches OpenAI's reference is not settled", strict=True)
def test_bf16_logits_on_cuda_equal_transformers():
    hf = gpt_oss_model().to(CUDA, torch.bfloat16)
    lathe = lathe_from_transformers(hf).eval()
    assert_logits_equal_transformers(hf, lathe, rel=3e-2)       # both in bf16, rounded in different orders


def test_bf16_logits_on_cuda_equal_lathes_fp32_cpu_forward():
    """lathe's CUDA path (grouped expert matmuls, sink attention) in bf16 against its own float32 CPU forward, which
    the CPU tests check against transformers."""
    from .lathe_tiny import ragged_batch
    cpu = lathe_from_transformers(gpt_oss_model()).eval()
    lathe = lathe_from_transformers(gpt_oss_model()).to(CUDA, torch.bfloat16).eval()
    ids, mask, pos = ragged_batch(0)
    real = mask.bool()
    with torch.no_grad():
        for mode in ("mask", "unpad"):
            cpu.padded_attention = lathe.padded_attention = mode
            ref = cpu(ids, mask, pos).logits[real]
            got = lathe(ids.to(CUDA), mask.to(CUDA), pos.to(CUDA)).logits[real.to(CUDA)].float().cpu()
            assert_close_rel(got, ref, rel=3e-2, name=f"padded logits ({mode})")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_on_cuda_equals_the_teacher_forced_forward(tmp_path, backend):
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    gpt_oss_model(seed=2).save_pretrained(tmp_path / "ckpt")
    model = load_lathe_model(tmp_path / "ckpt", torch.bfloat16, device=CUDA).eval()
    engine = LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend)
    assert engine.runner.decode_backend == backend and engine.runner.graphs is not None    # decode steps in graphs
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert engine.runner.graphs.captures > 0
    ref = load_lathe_model(tmp_path / "ckpt").eval()
    for prompt, ids, lps in zip(prompts, out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert_close_rel(lps, expected, rel=5e-2, name="engine log-probs (bf16) vs the fp32 forward")
