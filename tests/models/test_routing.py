"""Routing replay in compiled layers (`lathe.models.routing`, as the trainer compiles them on a GPU): each batch's
replayed routing is taken behind a graph break without recompiling, and layers recomputed in backward (gradient
checkpointing) replay it too."""

import pytest
import torch

from lathe.models import routing
from lathe.models.hf import lathe_from_transformers

from .lathe_tiny import MOE, hf_model


@pytest.mark.slow          # compiling the layers takes ~15 s of CPU
def test_replay_in_compiled_checkpointed_layers_does_not_recompile(monkeypatch):
    from lathe.models.compile import compile_decoder
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    monkeypatch.setattr("lathe.models.moe.grouped_mm_supported", lambda *a: True)
    seen, real = [], routing.replay_route
    monkeypatch.setattr(routing, "replay_route", lambda *a, **kw: seen.append(real(*a, **kw)[1]) or real(*a, **kw))
    torch._dynamo.reset()
    model = lathe_from_transformers(hf_model(MOE)).train().to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    compile_decoder(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for i in range(2):                 # the first batch compiles; the second, with routing of its own, may not
        ids = torch.randint(0, 100, (2, 7), generator=gen)
        given = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(14)]).view(14, 1, 2)
        given[3] = -1                                          # a token without a given choice routes itself
        seen.clear()
        with torch._dynamo.config.patch(error_on_recompile=i > 0), routing.replay_routing(model, given):
            model(ids).logits.float().pow(2).mean().backward()
        assert len(seen) == 2                                  # the forward and its recomputation in backward
        keep = torch.arange(14) != 3
        assert all(torch.equal(chosen[keep], given[keep, 0]) for chosen in seen)
        assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    torch._dynamo.reset()


@pytest.mark.parametrize("layers", [0, 1, None])
def test_replay_counts_each_choice_once_however_many_layers_recompute(layers):
    """A layer recomputed in backward replays its choices again, uncounted: `actor/routing_replay_changed` stays the
    share over (token, MoE layer) pairs when only the first layers recompute (`gradient_checkpointing_layers`)."""
    from lathe.models.config import LatheConfig
    from lathe.models.decoder import LatheCausalLM
    torch.manual_seed(0)
    model = LatheCausalLM(LatheConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 4, "mlp_only_layers": []})).train()
    model.gradient_checkpointing_enable(layers=layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (2, 5), generator=gen)
    given = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(20)]).view(10, 2, 2)
    stats = routing.ReplayStats()
    with routing.replay_routing(model, given, stats):
        model(ids).logits.pow(2).mean().backward()
    assert int(stats.given) == 10 * 2
