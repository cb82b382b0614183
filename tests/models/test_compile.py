"""Tests for lathe.models.compile: compiled layers and log-prob chunk math equal eager (values and gradients, with
and without gradient checkpointing), new packed lengths do not recompile, and compilation stays opt-in per instance.

The inductor case pays a real compile: ~55 s with a cold inductor cache on this 2-core machine (C++ builds),
~8 s once inductor's on-disk cache holds the kernels; it is marked slow (`-m "not slow"` skips it). The others use
the `aot_eager` backend, which traces, guards and recompiles exactly as inductor does but generates no code.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from lathe.models.compile import compile_decoder, compile_enabled, is_compiled, maybe_compile
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights
from lathe.models.logprob import chunked_log_probs
from lathe.models.packing import pack_sequences

from helpers import assert_close_rel

VOCAB = 97
OUTPUTS = ("logits", "logp", "entropy")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty dynamo caches, so graph counts and recompile limits are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiny(seed: int = 0) -> LatheCausalLM:
    """Qwen3-like (q/k norm) with q/k/v bias and tied embeddings: every branch of the layer code runs."""
    cfg = LatheConfig(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128, qkv_bias=True, qk_norm=True, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LatheCausalLM(cfg)
    init_weights(model, std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.train()


def _stream(lengths: list[int], seed: int = 0) -> dict:
    """A packed stream of ragged sequences and, for the loss, each position's next token."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, cu, max_len = pack_sequences([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[cu[1:].long() - 1] = False
    rows = keep.nonzero(as_tuple=True)[0]
    return dict(ids=ids, pos=pos, cu=cu, max_len=max_len, rows=rows, targets=ids[rows + 1])


def _step(model, s: dict, *, checkpointing: bool = False) -> dict:
    """One training step as the actor runs it: packed forward, chunked log-probs + entropy, backward."""
    model.zero_grad(set_to_none=True)
    (model.gradient_checkpointing_enable if checkpointing else model.gradient_checkpointing_disable)()
    hidden = model.forward_packed(s["ids"], s["pos"], s["cu"], s["max_len"])
    logp, ent = chunked_log_probs(hidden[s["rows"]], model.lm_head.weight, s["targets"], temperature=0.7,
                                  chunk_size=5, calculate_entropy=True, compile_backend=model.compile_backend)
    (-logp.mean() - 0.1 * ent.mean()).backward()
    with torch.no_grad():
        logits = model.lm_head(hidden)
    return {"logits": logits.detach(), "logp": logp.detach(), "entropy": ent.detach(),
            **{name: p.grad.clone() for name, p in model.named_parameters()}}


def _assert_close(got: dict, want: dict) -> None:
    """Each output alone; the gradients as one vector (a parameter's may be ~0, all rounding noise)."""
    for key in OUTPUTS:
        assert_close_rel(got[key], want[key], name=f"compiled {key}")
    grads = lambda step: {k: v for k, v in step.items() if k not in OUTPUTS}  # noqa: E731
    assert_close_rel(grads(got), grads(want), name="compiled gradients")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.slow), "aot_eager"])
def test_compiled_step_equals_eager_and_new_lengths_do_not_recompile(backend):
    eager = _tiny()
    compiled = compile_decoder(copy.deepcopy(eager), backend=backend)
    assert compiled.compile_backend == backend and eager.compile_backend is None
    for checkpointing in (False, True):
        s = _stream([7, 3, 11], seed=1)
        want = _step(eager, s, checkpointing=checkpointing)
        assert float(want["model.layers.0.mlp.up_proj.weight"].abs().max()) > 0, "precondition: gradients flow"
        _assert_close(_step(compiled, s, checkpointing=checkpointing), want)
    before = _graphs()
    assert before > 0, "precondition: something was compiled"
    for seed, lengths in enumerate([[4, 9], [13, 2, 6], [5, 5, 5, 8]]):   # other totals, chunk counts, last chunks
        s = _stream(lengths, seed=seed + 2)
        _assert_close(_step(compiled, s), _step(eager, s))
    assert _graphs() == before, f"new packed lengths recompiled {_graphs() - before} graph(s)"


def test_recompiles_stay_bounded_across_lengths_modes_and_layouts():
    start = _graphs()           # dynamo's counter is per process: earlier tests' graphs are not this test's
    model = compile_decoder(_tiny(), backend="aot_eager")
    kinds = {
        "train": lambda s: _step(model, s),
        "checkpointed": lambda s: _step(model, s, checkpointing=True),
        "no_grad": lambda s: torch.no_grad()(_step_no_grad)(model, s),
        "padded": lambda s: model(s["ids"][: 4 * (len(s["ids"]) // 4)].view(4, -1)).logits.sum().backward(),
    }
    for name, run in kinds.items():
        run(_stream([6, 3, 9], seed=0))                  # the first call of a kind may compile
        first = _graphs()
        for seed, lengths in enumerate([[2, 11], [8, 8, 4, 7]]):
            run(_stream(lengths, seed=seed + 1))
        assert _graphs() == first, f"{name}: {_graphs() - first} recompile(s) for new lengths"
    assert _graphs() - start <= 24, (f"{_graphs() - start} graphs for 4 kinds of call: something recompiles per layer "
                                     "or per call")


def test_an_engine_and_a_lora_trainer_fit_in_the_variant_limit():
    """One process holding a compiled engine copy and a compiled LoRA policy (a LoRA run on one device): the layers'
    shared code object collects a variant per attention type, grad mode, module types and size-1 batches. They must
    stay below dynamo's limit, or the next variant runs eager without a word (dynamo's default of 8 is reached)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models.decoder import DecoderLayer
    from lathe.models.lora import apply_lora
    engine_model = compile_decoder(_tiny().eval(), backend="aot_eager")
    engine = LatheEngine(engine_model, eos_token_id=None, block_size=4, num_kv_blocks=128, compile_model=False)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=0)
    engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], params)
    engine.generate([[9, 10, 11]], SamplingParams(n=1, temperature=1.0, max_tokens=3, seed=0))   # a batch of one
    plain, lora = _tiny(), _tiny()
    apply_lora(lora, rank=4, alpha=8)
    for model in (plain, lora):
        compile_decoder(model, backend="aot_eager")
        s = _stream([6, 3, 9])
        model.forward_packed(s["ids"], s["pos"], s["cu"], s["max_len"]).square().mean().backward()
        torch.no_grad()(_step_no_grad)(model, s)
    variants = len(_debug_get_cache_entry_list(DecoderLayer.forward.__code__))
    assert variants >= 8, f"precondition: {variants} variants, fewer than dynamo's default limit"
    assert variants < torch._dynamo.config.recompile_limit, (variants, torch._dynamo.config.recompile_limit)


def _step_no_grad(model, s: dict):
    hidden = model.forward_packed(s["ids"], s["pos"], s["cu"], s["max_len"])
    return chunked_log_probs(hidden[s["rows"]], model.lm_head.weight, s["targets"], chunk_size=5,
                             calculate_entropy=True, compile_backend=model.compile_backend)


def test_switch_off_and_cpu_leave_the_model_eager():
    model = _tiny()
    assert maybe_compile(model, False, device="cuda") is False
    assert maybe_compile(model, True) is False, "use_torch_compile on CPU runs eager by default"
    assert not is_compiled(model) and all(layer._compiled_call_impl is None for layer in model.model.layers)
    assert compile_enabled(True, "cuda") and not compile_enabled(False, "cuda") and not compile_enabled(True, "cpu")
    assert maybe_compile(model, True, device="cuda") is True   # nothing is traced until a forward
    assert is_compiled(model) and all(layer._compiled_call_impl is not None for layer in model.model.layers)


def test_compilation_is_per_instance():
    model = _tiny()
    copied, fresh = copy.deepcopy(model), LatheCausalLM(model.config)
    compile_decoder(model, backend="aot_eager")
    for other in (copied, fresh):
        assert not is_compiled(other) and all(layer._compiled_call_impl is None for layer in other.model.layers)
    s = _stream([5, 8])
    _step(model, s)
    compiled_graphs = _graphs()
    assert compiled_graphs > 0
    want = _step(copied, s)
    assert _graphs() == compiled_graphs, "running an uncompiled copy must not compile anything"
    _assert_close(_step(model, s), want)


def test_the_engine_split_decode_forms_take_the_decoders_mode(monkeypatch):
    """`compile_decoder(mode=...)` reaches the engine's split decode forms too (they compiled without it once: an A/B
    of inductor modes then measured the decode steps in the default mode on both sides)."""
    from lathe.engine import decode_forms
    seen = []
    monkeypatch.setattr(decode_forms.torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    decode_forms._compiled_split_forms.cache_clear()
    model = compile_decoder(_tiny(), backend="aot_eager", mode="max-autotune-no-cudagraphs")
    decoder = model.model
    assert (decoder.compile_backend, decoder.compile_mode) == ("aot_eager", "max-autotune-no-cudagraphs")
    seen.clear()                                   # (the layers' own compiles)
    decode_forms._compiled_split_forms(decoder.compile_backend, decoder.compile_mode)
    assert seen == [dict(backend="aot_eager", mode="max-autotune-no-cudagraphs")] * 2
    decode_forms._compiled_split_forms.cache_clear()


def test_compile_decoder_rejects_other_models():
    with pytest.raises(TypeError, match="LatheCausalLM or LatheValueModel"):
        compile_decoder(torch.nn.Linear(2, 2))
    assert maybe_compile(torch.nn.Linear(2, 2), True, device="cuda") is False


@pytest.mark.gpu
def test_cuda_bf16_varlen_compiled_step_matches_eager_and_does_not_recompile():
    """The GPU path: bf16, varlen attention left eager inside the compiled layers, inductor (Triton) kernels."""
    eager = _tiny().to("cuda", torch.bfloat16)
    assert eager.packed_backend() == "varlen"
    compiled = copy.deepcopy(eager)
    assert maybe_compile(compiled, True) and compiled.compile_backend == "inductor"
    cuda = lambda s: {k: v.cuda() if torch.is_tensor(v) else v for k, v in s.items()}  # noqa: E731
    s = cuda(_stream([37, 90, 12], seed=1))
    want, got = _step(eager, s), _step(compiled, s)
    for key in ("logits", "logp", "entropy", "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        scale = float(want[key].float().abs().max())
        diff = float((got[key].float() - want[key].float()).abs().max())
        assert diff <= 0.05 * scale, f"{key}: compiled differs from eager by {diff:.3g} (scale {scale:.3g})"
    before = _graphs()
    for seed, lengths in enumerate([[64, 5, 33], [120, 17], [9, 9, 9, 80]]):
        _step(compiled, cuda(_stream(lengths, seed=seed + 2)))
    assert _graphs() == before, f"new packed lengths recompiled {_graphs() - before} graph(s)"
