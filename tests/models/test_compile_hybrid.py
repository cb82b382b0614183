"""`compile_decoder` over the hybrid families (Qwen3.5, Qwen3-Next): the layers compile around what touches the
linear-attention states, which stays eager (`lathe.models.compile`). With the `aot_eager` backend (traces, guards and
recompiles as inductor does, generates no code): a training step equals eager, values and gradients; new packed
lengths do not recompile; and the engine's prefill and decode steps with compiled layers give the eager engine's
tokens and log-probs (the `LinearStep`'s layer counter runs on every call, outside the graphs)."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from lathe.models.compile import compile_decoder
from lathe.models.hf import lathe_from_transformers
from lathe.models.logprob import chunked_log_probs
from lathe.models.packing import pack_sequences

from helpers import assert_close_rel

from .lathe_tiny import VOCAB, hf_model

@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(family: str):
    return lathe_from_transformers(hf_model(family)).train()


def _step(model, lengths: list[int], seed: int) -> dict:
    """Packed forward, chunked log-probs of the next tokens, backward: outputs and every gradient."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, cu, max_len = pack_sequences([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[cu[1:].long() - 1] = False
    rows = keep.nonzero(as_tuple=True)[0]
    model.zero_grad(set_to_none=True)
    hidden = model.forward_packed(ids, pos, cu, max_len)
    logp, _ = chunked_log_probs(hidden[rows], model.lm_head.weight, ids[rows + 1], temperature=1.0, chunk_size=7,
                                compile_backend=model.compile_backend)
    (-logp.mean()).backward()
    return {"logp": logp.detach(),
            **{name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}}


def test_compiled_hybrid_step_equals_eager_and_new_lengths_do_not_recompile():
    eager = _model("qwen3_5_text")
    compiled = compile_decoder(copy.deepcopy(eager), backend="aot_eager")
    assert compiled.compile_backend == "aot_eager"
    want, got = _step(eager, [7, 3, 11], seed=1), _step(compiled, [7, 3, 11], seed=1)
    assert_close_rel(got["logp"], want["logp"], name="compiled log-probs")
    assert want.keys() == got.keys() and any("linear_attn" in k for k in want), "precondition: gradients flow"
    assert_close_rel({k: v for k, v in got.items() if k != "logp"}, {k: v for k, v in want.items() if k != "logp"},
                     name="compiled gradients")
    _step(compiled, [5, 9], seed=2)           # a second length: dynamo may make the token dimensions dynamic here
    before = counters["stats"]["unique_graphs"]
    assert before > 0, "precondition: something was compiled"
    for seed, lengths in enumerate([[13, 2, 6], [4, 4, 4, 8]]):
        assert_close_rel(_step(compiled, lengths, seed + 3)["logp"], _step(eager, lengths, seed + 3)["logp"],
                         name="compiled log-probs")
    assert counters["stats"]["unique_graphs"] == before, "new packed lengths recompiled"


def test_engine_with_compiled_hybrid_layers_equals_the_eager_engine():
    """Chunked prefill (sequences continuing from their states across steps), preemption and decode steps."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    eager = _model("qwen3_5_text").eval()
    compiled = compile_decoder(copy.deepcopy(eager), backend="aot_eager")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=2)
    outs, graphs = [], []
    for model in (eager, compiled):
        engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=10, reserve_new_tokens=False,
                             max_num_batched_tokens=4, compile_model=False)
        graphs.append(counters["stats"]["unique_graphs"])
        outs.append(engine.generate(prompts, params))
    graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] < graphs[2], f"precondition: only the compiled engine compiles ({graphs})"
    assert outs[0].metrics["rollout/num_preemptions"] > 0, "precondition: preemptions in the run"
    assert outs[1].token_ids == outs[0].token_ids
    for got, want in zip(outs[1].logprobs, outs[0].logprobs):
        assert_close_rel(got, want, name="compiled engine log-probs")
