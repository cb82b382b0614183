"""The engine's forms of the decoder (`lathe.engine.decode_forms`): fused projections, and the split-K layers (o_proj
and down_proj as partial products over K chunks, their sums and residual adds folded into the next norm) against the
layers' plain forward, and the engine that uses them."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import assert_close_rel


class _Attention:
    """A stand-in attention: a fixed mix of q and v (GQA heads repeated), so the layers' math is all that differs."""
    rotates = False
    rope = None

    def __init__(self, split_k=None):
        self.split_k = split_k

    def __call__(self, q, k, v):
        return 0.5 * q + v.repeat_interleave(q.shape[-2] // v.shape[-2], dim=-2)


def _model(family, seed=0):
    from lathe.engine.decode_forms import fuse_projections
    from lathe.models.hf import lathe_from_transformers
    from models.glm4_tiny import glm4_model
    from models.lathe_tiny import hf_model
    hf = glm4_model(seed=seed) if family == "glm4" else hf_model(family, seed=seed)
    model = lathe_from_transformers(hf).eval()
    fuse_projections(model)
    return model


def test_fused_projections_keep_logits_names_and_weight_syncs(tmp_path):
    """`fuse_projections` (the engine's one matmul for q/k/v and one for gate/up): the logits of every family are
    unchanged, the state dict keeps its HF names, and weights copied into `q_proj.weight` etc. reach the fused
    tensors (an engine's weight sync)."""
    from lathe.engine.decode_forms import FusedAttention, fuse_projections
    from lathe.models import load_lathe_model
    from lathe.models.io import copy_named_tensors
    from models.lathe_tiny import FAMILIES, VOCAB, save_hf
    for family in FAMILIES:
        path, _ = save_hf(tmp_path / family, family)
        model, other = load_lathe_model(path), load_lathe_model(path)
        ids = torch.randint(0, VOCAB, (2, 9))
        ref = model(ids).logits
        names = set(model.state_dict())
        fuse_projections(model)
        assert isinstance(model.model.layers[0].self_attn, FusedAttention) and set(model.state_dict()) == names
        assert_close_rel(model(ids).logits, ref, name=f"{family} fused logits")
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn_like(p))
        copy_named_tensors(model, other.state_dict().items(), who="test model")
        assert_close_rel(model(ids).logits, other(ids).logits, name=f"{family} logits after a weight copy")


def test_fused_projections_leave_lora_layers_alone(tmp_path):
    """A group holding a LoRA layer keeps its own forward (the adapters must act); the other groups fuse."""
    from lathe.engine.decode_forms import FusedAttention, FusedMLP, fuse_projections
    from lathe.models import load_lathe_model
    from lathe.models.lora import apply_lora, lora_layers
    from models.lathe_tiny import VOCAB, save_hf
    path, _ = save_hf(tmp_path, "qwen2")
    model = load_lathe_model(path)
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj"])
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.normal_()
    ids = torch.randint(0, VOCAB, (2, 9))
    ref = model(ids).logits
    fuse_projections(model)
    layer = model.model.layers[0]
    assert not isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
    assert_close_rel(model(ids).logits, ref, name="logits with LoRA q_proj")


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_linear_sums_to_the_linear(splits):
    from lathe.engine.decode_forms import split_linear
    g = torch.Generator().manual_seed(splits)
    lin = nn.Linear(64, 24, bias=False)
    x = torch.randn(3, 5, 64, generator=g, dtype=torch.float64)
    lin.weight.data = torch.randn(24, 64, generator=g, dtype=torch.float64)
    parts = split_linear(x, lin, splits)
    assert parts.shape == (splits, 3, 5, 24)
    assert_close_rel(parts.sum(0), lin(x), rel=1e-12, name="sum of partials")
    chunk = 64 // splits                   # partial i is the product over the i-th chunk of the input features
    assert_close_rel(parts[1], x[..., chunk:2 * chunk] @ lin.weight[:, chunk:2 * chunk].T, rel=1e-12, name="partial")


def test_split_linear_keeps_a_bias_a_subclass_a_strided_weight_and_an_uneven_split_whole():
    from lathe.engine.decode_forms import split_linear

    class Adapter(nn.Linear):                # a LoRA-like subclass: its own forward must run
        def forward(self, x):
            return super().forward(x) + 1.0
    strided = nn.Linear(12, 6, bias=False)
    strided.weight = nn.Parameter(torch.randn(12, 6).T)           # a transposed view: chunking it would copy it
    x = torch.randn(4, 12)
    for lin, splits in ((nn.Linear(12, 6, bias=True), 2), (Adapter(12, 6, bias=False), 2), (strided, 2),
                        (nn.Linear(12, 6, bias=False), 5), (nn.Linear(12, 6, bias=False), 1)):
        parts = split_linear(x, lin, splits)
        assert parts.shape == (1, 4, 6)
        assert torch.equal(parts[0], lin(x))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4"])
def test_split_decode_form_equals_the_plain_forward(family):
    """Every layer in its split form (partials handed to the next layer, the last sum before the final norm): the
    plain forward's hidden states, for several split pairs and batch sizes (a MoE layer's experts: one partial;
    GLM-4's norms on each output: its pending add one normed partial)."""
    from lathe.engine.decode_forms import text_hidden
    model = _model(family)
    with torch.no_grad():
        for rows in (1, 7):
            ids, pos = torch.randint(0, 100, (rows,)), torch.arange(rows) + 3
            ref = model.model(ids, pos, _Attention())
            assert torch.equal(text_hidden(model.model, ids, pos, _Attention()), ref)
            for pair in ((1, 1), (2, 2), (4, 2), (2, 4), (1, 8)):
                assert_close_rel(text_hidden(model.model, ids, pos, _Attention(pair)), ref, rel=1e-5,
                                 name=f"{family} {pair}")


@pytest.mark.parametrize("fused", [True, False])
def test_split_decode_form_of_an_fp8_model_runs_its_fp8_mlp_whole(monkeypatch, fused):
    """With FP8 projections the split form leaves the down projection to the MLP's own FP8 path (the SwiGLU and its
    quantisation: `fp8.mlp_down`), one partial per layer, gate/up fused or not (the engine fuses
    them only where the copy is small: not at 7B): the plain forward's hidden states."""
    from lathe.engine import fp8
    from lathe.engine.decode_forms import FusedMLP, text_hidden
    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hf_model
    model = _model("qwen2") if fused else lathe_from_transformers(hf_model("qwen2", seed=0)).eval()
    fp8.quantize_model(model)
    assert type(model.model.layers[0].mlp) is (FusedMLP if fused else fp8.Fp8MLP)
    calls = []
    monkeypatch.setattr(fp8, "mlp_down", lambda mlp, x, run=fp8.mlp_down: calls.append(1) or run(mlp, x))
    with torch.no_grad():
        ids, pos = torch.randint(0, 100, (5,)), torch.arange(5) + 3
        ref = model.model(ids, pos, _Attention())
        layers = len(model.model.layers)
        assert len(calls) == layers
        assert_close_rel(text_hidden(model.model, ids, pos, _Attention((2, 2))), ref, rel=1e-5, name="fp8 split")
        assert len(calls) == 2 * layers


def test_split_decode_form_compiles_once_for_all_layers_and_batches():
    """Compiled (`compile_decoder`), the split form is one code object for every layer: a model of four layers
    traces no more frames than one of two (layers share the compiled variants), and another batch size or a second
    run traces nothing new."""
    import copy
    from torch._dynamo.utils import counters
    from lathe.engine.decode_forms import text_hidden
    from lathe.models.compile import compile_decoder
    first_frames = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        model = _model("qwen2")
        while len(model.model.layers) < layers:          # more layers of the same shapes, other weights
            extra = copy.deepcopy(model.model.layers[-1])
            with torch.no_grad():
                for p in extra.parameters():
                    p.mul_(0.9)
            model.model.layers.append(extra)
        compile_decoder(model, backend="eager")
        with torch.no_grad():
            for rows in (5, 9, 16):
                ids, pos = torch.randint(0, 100, (rows,)), torch.arange(rows)
                ref = model.model(ids, pos, _Attention())
                counters.clear()
                out = text_hidden(model.model, ids, pos, _Attention((2, 2)))
                frames = counters["frames"]["ok"]
                assert_close_rel(out, ref, rel=1e-5, name=f"compiled split, {layers} layers, {rows} rows")
                if rows == 5:
                    assert frames > 0
                    first_frames[layers] = frames
                else:
                    assert frames == 0, f"{frames} frames traced again for {rows} rows"
    assert first_frames[4] == first_frames[2], first_frames


def test_engine_with_split_decode_equals_the_plain_engine(checkpoints, monkeypatch):
    """The engine's prefill and decode steps in the split form (the rule forced on, as on CUDA): the plain engine's
    tokens and log-probs, greedy and seeded."""
    from lathe.engine import decode_forms
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from .conftest import PROMPTS

    path, _ = checkpoints["qwen2"]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3)]
    outs, seen = [], []
    for split in (False, True):
        if split:
            # forced on both kinds of step (the real rule gives prefill steps (1, 1)), so that the split form's
            # prefill path is compared too
            monkeypatch.setattr(decode_forms, "step_split_k",
                                lambda model, rows, prefill=False: seen.append((rows, prefill)) or (2, 4))
        engine = LatheEngine(load_lathe_model(path, torch.float32), eos_token_id=None, block_size=4, num_kv_blocks=64)
        outs.append([engine.generate(PROMPTS, p) for p in params])
    # decode steps ask with their rows (at most 2 x 4 sequences), prefill steps with their new tokens (more), and say
    # they are prefill steps
    decode, prefill = {r for r, p in seen if not p}, {r for r, p in seen if p}
    assert len(PROMPTS) in decode and max(decode) <= 2 * len(PROMPTS), f"decode steps should ask: {seen}"
    assert prefill and max(prefill) > 2 * len(PROMPTS), f"prefill steps should ask as prefill steps: {seen}"
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert_close_rel(torch.tensor(sum(b.logprobs, [])), torch.tensor(sum(a.logprobs, [])), name="log-probs")


def test_step_split_k_rule(monkeypatch):
    """The plain forward where splitting was not measured to pay (an eager model, float32, the CPU); on CUDA, compiled
    in half precision, splits by the output's tiles against the GPU's SMs."""
    from lathe.engine import decode_forms
    from lathe.engine.decode_forms import _splits_for, step_split_k
    from lathe.models.compile import compile_decoder
    model = _model("qwen2")
    assert step_split_k(model, 256) is None                                    # eager
    compile_decoder(model, backend="eager")
    assert step_split_k(model, 256) is None                                    # float32
    assert step_split_k(model.to(torch.bfloat16), 256) is None                 # the CPU
    sms = 132
    assert _splits_for(256, 8960, 1536, sms) == 4          # 1.5B down: 96 tiles
    assert _splits_for(512, 8960, 1536, sms) == 2          # 192 tiles
    assert _splits_for(256, 18944, 3584, sms) == 2         # 7B down: 224 tiles
    assert _splits_for(512, 18944, 3584, sms) == 1         # 448 tiles
    assert _splits_for(256, 4864, 896, sms) == 2           # 0.5B down: 4 splits would leave 1216 features
    assert _splits_for(256, 896, 896, sms) == 1 and _splits_for(256, 3584, 3584, sms) == 1     # o_proj
    assert _splits_for(128, 8960, 1536, sms) == 1 and _splits_for(256, 4094, 896, sms) == 1    # few rows; K odd/2
    monkeypatch.setattr(decode_forms, "multiprocessor_count", lambda device: sms)
    on_cuda = SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(model, "get_input_embeddings", lambda: on_cuda)
    assert step_split_k(model, 256) == (1, 1)              # K = 32 and 64: too short to split
    monkeypatch.setattr(decode_forms, "_splits_for", lambda rows, k, n, num_sms: 4)
    assert step_split_k(model, 256) == (4, 4)
    assert step_split_k(model, 256, prefill=True) == (1, 1)        # a prefill never compiles a split variant


@pytest.mark.gpu
def test_cuda_bf16_split_decode_is_as_accurate_as_the_plain_form(checkpoints, monkeypatch):
    """On CUDA in bf16, compiled (the engine's default there), prefill and decode steps in the split form (forced to
    (2, 2)) and in the plain form: the sampled tokens' log-probs against a float32 teacher-forced forward on the CPU;
    the split form's worst error is within the plain form's (x1.5, + 0.01)."""
    from lathe.engine import decode_forms
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from .conftest import PROMPTS
    from .test_llm_engine import _teacher_forced

    path, _ = checkpoints["qwen2"]
    cpu_model = load_lathe_model(path)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=5)
    prompts = [p for p in PROMPTS for _ in range(2)]
    errors, seen = {}, []
    for form, rule in (("plain", lambda model, rows, prefill=False: None),
                       ("split", lambda model, rows, prefill=False: seen.append(rows) or (2, 2))):
        monkeypatch.setattr(decode_forms, "step_split_k", rule)
        engine = LatheEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, eos_token_id=None,
                                             block_size=4, num_kv_blocks=128)
        out = engine.generate(PROMPTS, params)
        errors[form] = max(float((torch.tensor(lps, dtype=torch.float64) - _teacher_forced(cpu_model, p, ids, 0.8))
                                 .abs().max()) for p, ids, lps in zip(prompts, out.token_ids, out.logprobs))
    assert seen, "the engine's steps never asked for their splits"
    assert errors["split"] <= 1.5 * errors["plain"] + 0.01, errors
