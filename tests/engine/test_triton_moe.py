"""The fused MoE decode kernels (`lathe.engine.triton_moe`), run in Triton's CPU interpreter, against
`experts_forward` (Qwen3-MoE's plain SwiGLU experts), GPT-OSS's own experts (biases, input-major interleaved
gate/up, the clamped SwiGLU) and Nemotron-H's (relu² without a gate); on a GPU, at Qwen3-30B-A3B's, GPT-OSS-20B's
and Nemotron-3-Nano's layer shapes."""

import copy

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lathe.models.moe import experts_forward  # noqa: E402
from helpers import assert_close_rel  # noqa: E402


@pytest.fixture(scope="module")
def moe(triton_interpreter):
    """lathe.engine.triton_moe, its kernels run by Triton's CPU interpreter."""
    from lathe.engine import triton_moe
    return triton_moe


def layer(e, h, i, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=g, device=device) * h ** -0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g, device=device) * i ** -0.5).to(dtype)
    return gate_up, down, g


def routing(tokens, e, k, g, only=None, device="cpu"):
    """Random top-k choices (over the experts `only`, when given: the others get no rows) and weights."""
    pool = torch.arange(e, device=device) if only is None else torch.tensor(only, device=device)
    scores = torch.rand(tokens, len(pool), generator=g, device=device)
    chosen = pool[scores.topk(k, dim=-1).indices]
    weights = torch.rand(tokens, k, generator=g, device=device).softmax(-1)
    return weights, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,e,k,h,i,only", [
    (1, 8, 2, 32, 24, None),            # one token: two experts of one row each; I not a multiple of the tile
    (20, 6, 2, 48, 16, [1, 4]),         # four experts without rows; two of 20 rows: a block of 16 and one of 4
])
def test_fused_equals_experts_forward(moe, dtype, tokens, e, k, h, i, only):
    gate_up, down, g = layer(e, h, i, dtype, seed=tokens + e)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    weights, chosen = routing(tokens, e, k, g, only)
    weights = weights.to(dtype)
    out = moe.fused_experts(x, weights, chosen, gate_up, down)
    ref = experts_forward(x.float(), weights.float(), chosen, gate_up.float(), down.float())
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_rel(out.float(), ref, rel=1e-5 if dtype == torch.float32 else 2e-2, name=f"fused experts {dtype}")


def gpt_oss_cfg(e, h, i, limit):
    from lathe.models.config import MoeConfig

    class Cfg:
        hidden_size = h
        moe = MoeConfig(num_experts=e, num_experts_per_tok=2, moe_intermediate_size=i, swiglu_alpha=1.702,
                        swiglu_limit=limit)
    return Cfg()


def gpt_oss_random(module, g, h, i, device="cpu"):
    """Random weights and non-zero biases in `module`'s GPT-OSS experts (and router), in place."""
    scales = {"gate_up_proj": h ** -0.5, "down_proj": i ** -0.5}
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * scales.get(name.split(".")[-1], 0.5))
    return module


def gpt_oss_experts(e, h, i, dtype, seed, limit, device="cpu"):
    """A `GptOssExperts` with random weights and non-zero biases, and its generator."""
    from lathe.models.gpt_oss import GptOssExperts
    g = torch.Generator(device=device).manual_seed(seed)
    experts = gpt_oss_random(GptOssExperts(gpt_oss_cfg(e, h, i, limit)).to(device), g, h, i, device)
    return experts.to(dtype), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,e,k,h,i,only", [
    (1, 8, 2, 32, 24, None),            # one token; I not a multiple of the tile (the interleaved tile's edge)
    (20, 6, 4, 48, 16, [0, 2, 3, 5]),   # two experts without rows; rows across a block boundary
])
def test_fused_gpt_oss_equals_its_experts(moe, dtype, tokens, e, k, h, i, only):
    """GPT-OSS's experts (input-major weights, interleaved gate/up, biases, clamped SwiGLU) through the fused kernels
    as the engine passes them (`experts_args`): the sum of `GptOssExperts.forward` (its block's path), in float32."""
    from lathe.models.moe import sorted_forward
    experts, g = gpt_oss_experts(e, h, i, dtype, seed=tokens + e, limit=0.5)
    x = (torch.randn(tokens, h, generator=g) * 2).to(dtype)
    weights, chosen = routing(tokens, e, k, g, only)
    weights = weights.to(dtype)
    out = moe.fused_experts(x, weights, chosen, *moe.experts_args(experts))
    reference = copy.deepcopy(experts).float()
    with torch.no_grad():
        ref = sorted_forward(x.float(), weights.float(), chosen, reference)
        pre = torch.einsum("th,tjhn->tjn", x.float(), reference.gate_up_proj[chosen]) + \
            reference.gate_up_proj_bias[chosen]
    assert (pre[..., ::2] > 0.5).float().mean() > 0.2 and (pre[..., 1::2].abs() > 0.5).float().mean() > 0.2, \
        "precondition: the clamps act on many gate and up values"
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_rel(out.float(), ref, rel=1e-5 if dtype == torch.float32 else 2e-2, name=f"fused GPT-OSS {dtype}")


def nemotron_experts(e, h, i, dtype, seed, device="cpu"):
    """A `NemotronExperts` (up (E, I, H), down (E, H, I)) with random weights, and its generator."""
    from lathe.models.nemotron_h import NemotronExperts
    g = torch.Generator(device=device).manual_seed(seed)
    experts = NemotronExperts(e, h, i).to(device)
    with torch.no_grad():
        experts.up_proj.copy_(torch.randn(e, i, h, generator=g, device=device) * h ** -0.5)
        experts.down_proj.copy_(torch.randn(e, h, i, generator=g, device=device) * i ** -0.5)
    return experts.to(dtype), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,e,k,h,i,only", [
    (1, 8, 3, 32, 24, None),            # one token; I not a multiple of the tile
    (20, 6, 2, 48, 16, [1, 4, 5]),      # three experts without rows; rows across a block boundary
])
def test_fused_nemotron_equals_its_experts(moe, dtype, tokens, e, k, h, i, only):
    """Nemotron-H's experts (one up projection, relu² between it and down) through the fused kernels as the engine
    passes them (`experts_args`, `experts_kwargs`): the sum of `NemotronExperts.forward` in float32."""
    from lathe.models.moe import sorted_forward
    experts, g = nemotron_experts(e, h, i, dtype, seed=tokens + e)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    weights, chosen = routing(tokens, e, k, g, only)
    weights = weights.to(dtype)
    assert moe.experts_kwargs(experts) == {"relu2": True}
    out = moe.fused_experts(x, weights, chosen, *moe.experts_args(experts), **moe.experts_kwargs(experts))
    with torch.no_grad():
        ref = sorted_forward(x.float(), weights.float(), chosen, copy.deepcopy(experts).float())
        pre = torch.einsum("th,tjnh->tjn", x.float(), experts.up_proj.float()[chosen])
    assert 0.2 < (pre > 0).float().mean() < 0.8, "precondition: the relu cuts some up values and passes others"
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_rel(out.float(), ref, rel=1e-5 if dtype == torch.float32 else 2e-2, name=f"fused Nemotron {dtype}")
    with pytest.raises(ValueError, match="two activations"):
        moe.fused_experts(x, weights, chosen, *moe.experts_args(experts)[:3], (1.0, 7.0), relu2=True)


@pytest.mark.parametrize("latent", [None, 24])
def test_nemotron_blocks_use_the_hook(moe, tmp_path, latent):
    """A lathe Nemotron-H's sparse blocks (with and without latent projections around the routed experts) are
    fusable, and with `decode_experts` set compute their experts there: the model's logits as without."""
    from lathe.models import load_lathe_model
    from models.nemotron_tiny import nemotron_model
    nemotron_model(seed=3, **({} if latent is None else {"moe_latent_size": latent})).save_pretrained(tmp_path)
    model = load_lathe_model(tmp_path)
    blocks = moe.fusable_blocks(model)
    assert len(blocks) == 2 and all(b.latent == latent for b in blocks)
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        ref = model(ids).logits
        moe.set_decode_experts(blocks, True)
        out = model(ids).logits
    assert_close_rel(out, ref, rel=1e-5, name="Nemotron-H with the fused experts")


def test_gpt_oss_block_uses_the_hook(moe):
    """GPT-OSS's sparse block with `decode_experts` set computes its experts there (`fusable_blocks` serves it):
    the same output as without (router bias, non-zero expert biases, the clamps acting)."""
    from lathe.models.gpt_oss import GptOssMoeBlock
    block = gpt_oss_random(GptOssMoeBlock(gpt_oss_cfg(4, 32, 16, 0.5)), torch.Generator().manual_seed(0), 32, 16)
    assert moe.fusable_blocks(block) == [block]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 2
    ref = block(x)
    moe.set_decode_experts([block], True)
    out = block(x)
    assert_close_rel(out, ref, rel=1e-5, name="GPT-OSS block with the fused experts")


def test_the_probe_never_chooses_a_fused_path_that_computes_another_sum(moe, monkeypatch):
    """The engine's probe (`choose_moe_backend`) keeps the fused experts only where their outputs agree with
    `experts_forward`'s: a fused path that is faster but wrong is skipped (here forced onto the CPU, the fused kernels
    in the interpreter, the timing faked in the fused path's favour)."""
    from lathe.models.gpt_oss import GptOssMoeBlock
    block = gpt_oss_random(GptOssMoeBlock(gpt_oss_cfg(4, 32, 16, 0.5)), torch.Generator().manual_seed(0), 32, 16)
    monkeypatch.setattr(moe, "usable", lambda device, dtype: True)
    times = iter([1.0, 2.0])
    monkeypatch.setattr(moe, "_time", lambda run, device: (run(), next(times))[1])     # fused first: faster
    assert moe.choose_moe_backend(block, 4)[0] == "triton_fused"
    right = moe.fused_experts
    monkeypatch.setattr(moe, "fused_experts", lambda *a, **k: right(*a, **k) * 1.1)
    times = iter([2.0])                                               # only experts_forward is timed
    assert moe.choose_moe_backend(block, 4) == ("experts_forward", {"experts_forward": 2.0})


def test_a_gpt_oss_probe_never_takes_the_choice_remembered_for_a_plain_layer_of_its_shape(moe, monkeypatch):
    """The probe's remembered choice is keyed by the experts' variant as well as their shape: GPT-OSS's (biases, a
    clamped SwiGLU) and a Qwen3-MoE layer's of the same size (4 experts of 32 x 16, top-2) run other kernels. (On an
    H200 the tiny GPT-OSS took the tiny Qwen3-MoE's remembered choice, 2026-12-02.)"""
    from lathe.models.config import MoeConfig
    from lathe.models.gpt_oss import GptOssMoeBlock
    from lathe.models.moe import SparseMoeBlock

    class Cfg:
        hidden_size = 32
        moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)

    keys = []
    monkeypatch.setattr(moe, "usable", lambda device, dtype: True)
    monkeypatch.setattr(moe.choices, "key", lambda probe, device: probe)
    monkeypatch.setattr(moe, "pick_fastest", lambda candidates, time_one, what, remember: keys.append(remember))
    moe.choose_moe_backend(SparseMoeBlock(Cfg()), 4)
    moe.choose_moe_backend(GptOssMoeBlock(gpt_oss_cfg(4, 32, 16, 0.5)), 4)
    assert len(keys) == 2 and keys[0] != keys[1] and "clamped SwiGLU" in keys[1], keys


def test_sparse_block_uses_the_hook_and_routing_is_recorded_first(moe):
    """A block with `decode_experts` set computes its experts there, after the router (replay's recording is the
    router's): the same output as without."""
    from lathe.models.config import MoeConfig
    from lathe.models.moe import SparseMoeBlock

    class Cfg:
        hidden_size = 32
        moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)

    torch.manual_seed(0)
    block = SparseMoeBlock(Cfg())
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 32)
    seen = []
    block.set_routing(lambda probs, k, norm: seen.append(probs) or torch.topk(probs, k, dim=-1))
    ref = block(x)
    block.decode_experts = moe.fused_experts
    out = block(x)
    assert len(seen) == 2
    assert_close_rel(out, ref, rel=1e-5, name="block with the fused experts")


def test_rows_bucket_and_prune(moe):
    assert [moe.rows_bucket(r) for r in (1, 8, 9, 32, 33, 2048, 2049)] == [8, 8, 32, 32, 128, 2048, 8192]
    # T=1 of top-8 over 128 experts: only the 16-row blocks; 512 tokens: every BLOCK_M
    assert {c.kwargs["BLOCK_M"] for c in moe._prune(moe.CONFIGS, {"rows_key": 8, "num_experts": 128})} == {16}
    assert {c.kwargs["BLOCK_M"] for c in moe._prune(moe.CONFIGS, {"rows_key": 8192, "num_experts": 128})} == {16, 32,
                                                                                                               64}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "nemotron_h"])
def test_engine_decode_steps_use_the_fused_experts_and_prefill_does_not(moe, tmp_path, monkeypatch, family):
    """The engine's wiring on CPU (the kernels interpreted), the fused path forced: decode steps call it, prefill
    steps do not, and the greedy tokens are transformers' (Qwen3-MoE; GPT-OSS with its biases, clamps and sinks;
    Nemotron-H, its relu² experts beside Mamba2 layers)."""
    from lathe.engine import model_runner
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from models.gpt_oss_tiny import gpt_oss_model
    from models.lathe_tiny import MOE, save_hf
    from models.nemotron_tiny import nemotron_model
    from .conftest import PROMPTS
    from .test_llm_engine import _hf_greedy

    if family == MOE:
        path, hf = save_hf(tmp_path, MOE)
    else:
        path, hf = tmp_path / family, (gpt_oss_model if family == "gpt_oss" else nemotron_model)(seed=2)
        hf.save_pretrained(path)
    rows, fused = [], moe.fused_experts

    def spy(x, *args, **kwargs):
        rows.append(x.shape[0])
        return fused(x, *args, **kwargs)
    monkeypatch.setattr(model_runner, "choose_moe_backend", lambda model, max_rows: ("triton_fused", {}))
    monkeypatch.setattr(moe, "fused_experts", spy)
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64,
                                         enable_prefix_caching=False)
    prompts = PROMPTS[:2]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert out.token_ids == [_hf_greedy(hf, p, 3) for p in prompts]
    sparse = 1 if family == MOE else 2          # the tiny Qwen3-MoE's layer 0 is dense
    assert rows == [2] * 2 * sparse, "one call per sparse layer and decode step (the first token comes from " \
                                     "prefill), none from prefill"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256])
def test_fused_equals_experts_forward_cuda_30b_a3b(tokens):
    """Qwen3-30B-A3B's layer (128 experts of 2048 x 768, top-8) in bfloat16: the autotuned kernels against
    `experts_forward` (torch's grouped matmuls), both against the float32 loop."""
    from lathe.engine.triton_moe import fused_experts
    gate_up, down, g = layer(128, 2048, 768, torch.bfloat16, seed=tokens, device="cuda")
    x = torch.randn(tokens, 2048, generator=g, device="cuda").to(torch.bfloat16)
    weights, chosen = routing(tokens, 128, 8, g, device="cuda")
    weights = weights.to(torch.bfloat16)
    out = fused_experts(x, weights, chosen, gate_up, down)
    grouped = experts_forward(x, weights, chosen, gate_up, down)
    exact = experts_forward(x.float(), weights.float(), chosen, gate_up.float(), down.float())
    assert_close_rel(out.float(), exact, rel=1e-2, name="fused vs float32")
    assert_close_rel(grouped.float(), exact, rel=1e-2, name="grouped vs float32")
    assert_close_rel(out.float(), grouped.float(), rel=2e-2, name="fused vs grouped")
    torch.testing.assert_close(fused_experts(x, weights, chosen, gate_up, down), out, rtol=0, atol=0)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256])
def test_fused_equals_gpt_oss_experts_cuda_20b(tokens):
    """GPT-OSS-20B's layer (32 experts of 2880 x 2880, top-4, alpha 1.702, limit 7; inputs scaled so the clamps
    act) in bfloat16: the autotuned kernels against `experts_forward` as `GptOssExperts` runs it (torch's grouped
    matmuls over the transposed tensors), both against the float32 loop."""
    from lathe.engine.triton_moe import experts_args, fused_experts
    from lathe.models.moe import experts_forward
    experts, g = gpt_oss_experts(32, 2880, 2880, torch.bfloat16, seed=tokens, limit=7.0, device="cuda")
    x = (torch.randn(tokens, 2880, generator=g, device="cuda") * 4).to(torch.bfloat16)
    weights, chosen = routing(tokens, 32, 4, g, device="cuda")
    weights = weights.to(torch.bfloat16)
    args = experts_args(experts)
    out = fused_experts(x, weights, chosen, *args)
    grouped = experts_forward(x, weights, chosen, *args[:3], experts.act)
    exact = experts_forward(x.float(), weights.float(), chosen, *experts_args(copy.deepcopy(experts).float())[:3],
                            experts.act)
    assert_close_rel(out.float(), exact, rel=1e-2, name="fused vs float32")
    assert_close_rel(grouped.float(), exact, rel=1e-2, name="grouped vs float32")
    assert_close_rel(out.float(), grouped.float(), rel=2e-2, name="fused vs grouped")
    torch.testing.assert_close(fused_experts(x, weights, chosen, *args), out, rtol=0, atol=0)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256])
def test_fused_equals_nemotron_experts_cuda_nano(tokens):
    """Nemotron-3-Nano's layer (128 experts of 2688 x 1856, top-6, relu² without a gate) in bfloat16: the autotuned
    kernels against `experts_forward` as `NemotronExperts` runs it (torch's grouped matmuls), both against the
    float32 loop."""
    from lathe.engine.triton_moe import experts_args, experts_kwargs, fused_experts
    from lathe.models.nemotron_h import relu2
    experts, g = nemotron_experts(128, 2688, 1856, torch.bfloat16, seed=tokens, device="cuda")
    x = torch.randn(tokens, 2688, generator=g, device="cuda").to(torch.bfloat16)
    weights, chosen = routing(tokens, 128, 6, g, device="cuda")
    weights = weights.to(torch.bfloat16)
    args, keywords = experts_args(experts), experts_kwargs(experts)
    out = fused_experts(x, weights, chosen, *args, **keywords)
    grouped = experts_forward(x, weights, chosen, *args[:3], relu2)
    exact = experts_forward(x.float(), weights.float(), chosen, *experts_args(copy.deepcopy(experts).float())[:3],
                            relu2)
    assert_close_rel(out.float(), exact, rel=1e-2, name="fused vs float32")
    assert_close_rel(grouped.float(), exact, rel=1e-2, name="grouped vs float32")
    assert_close_rel(out.float(), grouped.float(), rel=2e-2, name="fused vs grouped")
    torch.testing.assert_close(fused_experts(x, weights, chosen, *args, **keywords), out, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "nemotron_h"])
@pytest.mark.parametrize("backend", ["triton_fused", "experts_forward"])
def test_cuda_engine_decodes_with_the_fused_experts_in_graphs(tmp_path, monkeypatch, family, backend):
    """A tiny Qwen3-MoE, GPT-OSS or Nemotron-H engine in bfloat16 on CUDA, its decode steps' experts fused (replayed
    from CUDA graphs) or not: the log-probs of its greedy tokens equal the float32 forward's, teacher-forced; prefill
    keeps `experts_forward`. The probe itself runs (and tunes) on the model, whatever it picks."""
    from lathe.engine import model_runner, triton_moe
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from models.gpt_oss_tiny import gpt_oss_model
    from models.lathe_tiny import MOE, save_hf
    from models.nemotron_tiny import nemotron_model
    from .conftest import PROMPTS
    from .test_llm_engine import _teacher_forced

    # (a probe measures both candidates only where no choice is remembered for its key: this test's own cache)
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path / "cache"))
    if family == MOE:
        path, _ = save_hf(tmp_path, MOE)
    else:
        path = tmp_path / family
        (gpt_oss_model if family == "gpt_oss" else nemotron_model)(seed=2).save_pretrained(path)
    probed = []

    def choose(model, rows):
        probed.append(triton_moe.choose_moe_backend(model, rows))
        return backend, {}
    monkeypatch.setattr(model_runner, "choose_moe_backend", choose)
    engine = LatheEngine.from_pretrained(path, dtype=torch.bfloat16, device="cuda", eos_token_id=None, block_size=4,
                                         num_kv_blocks=128, max_num_seqs=16)     # (few buckets to tune)
    assert probed[0][0] in triton_moe.MOE_CANDIDATES and set(probed[0][1]) == set(triton_moe.MOE_CANDIDATES)
    assert engine.runner.graphs is not None and engine.runner.moe_backend == backend
    blocks = triton_moe.fusable_blocks(engine.model)
    assert blocks and all((b.decode_experts is not None) == (backend == "triton_fused") for b in blocks)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=12))
    assert engine.runner.graphs.captures > 0
    model = load_lathe_model(path)
    for i, (ids, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        assert_close_rel(lps, _teacher_forced(model, PROMPTS[i // 2], ids, 1.0), rel=5e-2, name=f"log-probs {i}")
