"""The families and engine features that landed after the last GPU run, on CUDA in bf16 against lathe's own fp32
CPU forward of the same tokens: DeepSeek-V3's latent attention (v padded to q/k's width in the varlen kernel, its
decode on the torch and Triton backends), GPT-OSS's decode steps (sinks, sliding windows) replayed from CUDA graphs,
and routing replay's record of each token's experts written from CUDA graphs. (CPU tests check each against
transformers.)"""

import pytest
import torch

from helpers import assert_close_rel

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [5, 9, 2, 33, 7, 1, 8]]


def _teacher_log_probs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deepseek_engine_on_cuda_equals_the_fp32_forward(tmp_path, backend):
    from models.deepseek_tiny import deepseek_model

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    deepseek_model(seed=2).save_pretrained(tmp_path / "ckpt")
    model = load_lathe_model(tmp_path / "ckpt", torch.bfloat16, device=CUDA).eval()
    engine = LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    ref = load_lathe_model(tmp_path / "ckpt").eval()
    for prompt, ids, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        assert_close_rel(lps, _teacher_log_probs(ref, prompt, ids), rel=5e-2, name="engine (bf16) vs fp32 forward")


def test_deepseek_packed_bf16_logits_on_cuda_equal_the_fp32_cpu_forward(tmp_path):
    """Latent attention (every expert chosen, so routing cannot flip): the varlen kernel over v padded to q/k's
    head width."""
    from models.deepseek_tiny import deepseek_model

    from lathe.models import load_lathe_model
    deepseek_model(seed=3, num_experts_per_tok=8, topk_group=4).save_pretrained(tmp_path / "ckpt")   # all experts:
    # no routing flips between the precisions
    cpu = load_lathe_model(tmp_path / "ckpt").eval()
    gpu = load_lathe_model(tmp_path / "ckpt", torch.bfloat16, device=CUDA).eval()
    ids = torch.tensor([[3, 9, 4, 7, 1, 2, 8, 5], [6, 2, 7, 0, 0, 0, 0, 0]])
    mask = (ids > 0).long()
    mask[1, 0] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        want = cpu(ids, mask, pos).logits[real]
        got = gpu(ids.to(CUDA), mask.to(CUDA), pos.to(CUDA)).logits[real.to(CUDA)].float().cpu()
    assert_close_rel(got, want, rel=3e-2, name="bf16 CUDA logits vs fp32 CPU")


def test_routing_recorded_under_cuda_graphs_is_the_forwards(tmp_path):
    """Qwen3-MoE decode steps replay CUDA graphs; each token's recorded experts must be the ones its own forward
    picks (a bf16 near-tie may flip one: at least 95% of the (token, layer) choices agree as sets)."""
    from models.lathe_tiny import MOE, save_hf

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from lathe.models.routing import record_routing
    path, _ = save_hf(tmp_path, MOE)
    model = load_lathe_model(path, torch.bfloat16, device=CUDA).eval()
    engine = LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, record_routing=True)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3))
    assert engine.runner.graphs is not None, "the decode steps ran without CUDA graphs"
    agree = total = 0
    for prompt, resp, rec in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.routed_experts):
        ids = prompt + resp
        with torch.no_grad(), record_routing(model) as seen:
            model(torch.tensor([ids], device=CUDA))
        forward = torch.stack([layer[0] for layer in seen], dim=1).cpu()
        same = (rec[:-1].long().sort(-1).values == forward[:-1].long().sort(-1).values).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree >= 0.95 * total, f"{agree} of {total} recorded choices are the forward's"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_decode_graphs_equal_eager_decode(tmp_path, backend):
    """Sinks and sliding windows (a window of 4, shorter than the prompts) under CUDA graphs: the same tokens as the
    eager steps, and log-probs of the fp32 forward's."""
    from models.gpt_oss_tiny import gpt_oss_model

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    gpt_oss_model(seed=2).save_pretrained(tmp_path / "ckpt")
    model = load_lathe_model(tmp_path / "ckpt", torch.bfloat16, device=CUDA).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    outs = {}
    for eager in (True, False):
        engine = LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend,
                             enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager
        outs[eager] = engine.generate(PROMPTS, params)
        if not eager:
            assert engine.runner.graphs.captures > 0, "no decode graph was captured"
    assert outs[False].token_ids == outs[True].token_ids
    ref = load_lathe_model(tmp_path / "ckpt").eval()
    for prompt, ids, lps in zip([p for p in PROMPTS for _ in range(2)], outs[False].token_ids, outs[False].logprobs):
        assert_close_rel(lps, _teacher_log_probs(ref, prompt, ids), rel=5e-2, name="graph decode (bf16) vs fp32")


def assert_graphs_eager_and_packed_agree(model, ref, outs) -> None:
    """`outs` {enforce_eager: the engine's output} of PROMPTS (n=2, greedy) on `model` (bf16, CUDA): graph decode
    gives the eager steps' tokens and the log-probs of `ref` (the fp32 CPU model), and the packed bf16 forward its
    logits."""
    from lathe.models.packing import pack_sequences
    assert outs[False].token_ids == outs[True].token_ids
    for prompt, ids, lps in zip([p for p in PROMPTS for _ in range(2)], outs[False].token_ids, outs[False].logprobs):
        assert_close_rel(lps, _teacher_log_probs(ref, prompt, ids), rel=5e-2, name="graph decode (bf16) vs fp32")
    seqs = [torch.tensor(p + ids) for p, ids in zip(PROMPTS, outs[False].token_ids[::2])]
    with torch.no_grad():
        ids, pos, cu, mx = pack_sequences(seqs)
        got = model.forward_packed(ids.to(CUDA), pos.to(CUDA), cu.to(CUDA), mx, return_hidden=False).float().cpu()
        want = ref.forward_packed(ids, pos, cu, mx, return_hidden=False)
    assert_close_rel(got, want, rel=5e-2, name="packed bf16 logits on CUDA vs fp32 CPU")


@pytest.mark.parametrize("family", ["mistral_window", "seed_oss"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_llama_like_families_on_cuda_equal_the_fp32_forward(tmp_path, family, backend):
    """Mistral's sliding window on every layer (5 tokens) and Seed-OSS's q/k/v bias: decode graphs give the eager
    steps' tokens and the fp32 forward's log-probs, and the packed bf16 training forward its logits."""
    from models.lathe_tiny import save_hf

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    path, _ = save_hf(tmp_path, family, seed=2)
    model = load_lathe_model(path, torch.bfloat16, device=CUDA).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    outs = {eager: LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend,
                               enforce_eager=eager).generate(PROMPTS, params) for eager in (True, False)}
    assert_graphs_eager_and_packed_agree(model, load_lathe_model(path).eval(), outs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["glm4_moe", "hy_v3"])
def test_glm_4_5_and_hy_v3_on_cuda_equal_the_fp32_forward(tmp_path, family, backend):
    """GLM-4.5 (RoPE over half of each head, so the decode attention cannot rotate in its launch) and HY-V3 (q/k norms,
    whole-head RoPE rotated in the launch; its checkpoint under the hub's names), both on DeepSeek's sigmoid-router MoE
    block, on the engine's fused experts when the probe picks them: decode graphs give the eager steps' tokens and the
    fp32 forward's log-probs (every expert chosen, so routing cannot flip between the precisions), and the packed bf16
    training forward its logits."""
    from models.glm_tiny import glm_model
    from models.hy_tiny import hy_model

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    every_expert = {"glm4_moe": lambda: glm_model(seed=2, num_experts_per_tok=8, topk_group=4),
                    "hy_v3": lambda: hy_model(seed=2, num_experts_per_tok=8)}[family]
    every_expert().save_pretrained(tmp_path)
    model = load_lathe_model(tmp_path, torch.bfloat16, device=CUDA).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    engines = {eager: LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend,
                                  enforce_eager=eager) for eager in (True, False)}
    assert engines[False].runner.graphs is not None, f"{family}'s decode steps ran without CUDA graphs"
    outs = {eager: engine.generate(PROMPTS, params) for eager, engine in engines.items()}
    assert_graphs_eager_and_packed_agree(model, load_lathe_model(tmp_path).eval(), outs)



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_glm4_on_cuda_equals_the_fp32_forward(tmp_path, backend):
    """GLM-4 (its q/k rows permuted to RoPE's halves over half of each head: `lathe.models.glm4`; norms on the
    attention's and MLP's outputs, so no split-K decode form): decode graphs give the eager steps' tokens and the fp32
    forward's log-probs, and the packed bf16 training forward its logits."""
    from models.glm4_tiny import glm4_model

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    glm4_model(seed=2).save_pretrained(tmp_path)
    model = load_lathe_model(tmp_path, torch.bfloat16, device=CUDA).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    engines = {eager: LatheEngine(model, eos_token_id=None, block_size=16, num_kv_blocks=64, decode_backend=backend,
                                  enforce_eager=eager) for eager in (True, False)}
    assert engines[False].runner.graphs is not None, "GLM-4's decode steps ran without CUDA graphs"
    outs = {eager: engine.generate(PROMPTS, params) for eager, engine in engines.items()}
    assert_graphs_eager_and_packed_agree(model, load_lathe_model(tmp_path).eval(), outs)
