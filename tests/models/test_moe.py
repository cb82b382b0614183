"""Qwen3-MoE in lathe's decoder against transformers' `Qwen3MoeForCausalLM`: logits (padded and packed, norm_topk_prob
on and off), gradients, the load-balancing loss, checkpoint layouts, and the grouped-matmul path against the loop."""

import pytest
import torch

from lathe.models.hf import lathe_from_transformers
from lathe.models.moe import SparseMoeBlock, collect_router_stats, experts_forward, fuse_expert_weights, \
    megatron_router_coefs, router_aux_loss_coef, split_expert_weights

from helpers import assert_close_rel

from .lathe_tiny import MOE, hf_model, save_hf
from .moe_reference import assert_logits_equal_transformers, aux_and_gradients, round_trip


@pytest.fixture(scope="module", params=[True, False], ids=lambda n: f"norm_topk_prob={n}")
def pair(request):
    hf = hf_model(MOE, norm_topk_prob=request.param)
    return hf, lathe_from_transformers(hf).eval()


def test_padded_and_packed_logits_equal_transformers(pair):
    hf, lathe = pair
    assert isinstance(lathe.model.layers[1].mlp, SparseMoeBlock) and not isinstance(lathe.model.layers[0].mlp,
                                                                                     SparseMoeBlock)
    assert_logits_equal_transformers(hf, lathe)                 # ragged rows of up to 20 tokens


def test_aux_loss_and_gradients_equal_transformers(pair):
    hf, lathe = pair
    stats, aux, ref_aux, grads, ref, tokens = aux_and_gradients(hf, lathe)
    assert stats.rows == tokens                          # one sparse layer, the real tokens only
    assert_close_rel(aux, ref_aux, name="load-balancing loss")
    grads = {n: g for n, g in grads.items() if ".mlp." in n}
    ref = {n: g for n, g in ref.items() if n in grads}
    assert set(ref) == set(grads) and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert "model.layers.1.mlp.gate.weight" in grads and "model.layers.1.mlp.experts.gate_up_proj" in grads
    assert_close_rel(grads, ref, rel=1e-4, name="gradients of the MLPs, router and experts")


def test_router_stats_with_gradient_checkpointing_record_each_layer_once():
    lathe = lathe_from_transformers(hf_model(MOE)).train()
    lathe.gradient_checkpointing_enable()
    ids = torch.randint(0, 100, (2, 7))
    with collect_router_stats(lathe, keep_logits=True) as stats:
        logits = lathe(ids).logits
    (logits.pow(2).mean() + stats.aux_loss() + sum(stats.megatron_losses())).backward()
    assert stats.rows == 14 and len(stats.prob_per_expert) == 1
    assert lathe.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_router_stats_with_checkpointing_in_compiled_grouped_layers(monkeypatch):
    """Compiled layers on the grouped matmul (no graph break of their own; bf16, as on a GPU) with gradient
    checkpointing: the recomputed layers run the forward's graphs (the recording call's break included)."""
    from lathe.models.compile import compile_decoder
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    monkeypatch.setattr("lathe.models.moe.grouped_mm_supported", lambda *a: True)
    torch._dynamo.reset()
    lathe = lathe_from_transformers(hf_model(MOE)).train().to(torch.bfloat16)
    lathe.gradient_checkpointing_enable()
    compile_decoder(lathe, backend="aot_eager")
    for rows in (7, 9):
        with collect_router_stats(lathe) as stats:
            logits = lathe(torch.randint(0, 100, (2, rows))).logits
        (logits.float().pow(2).mean() + stats.aux_loss()).backward()
        assert stats.rows == 2 * rows
    assert lathe.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    torch._dynamo.reset()


def test_aux_loss_weight_follows_output_router_logits():
    hf = hf_model(MOE)
    assert router_aux_loss_coef(lathe_from_transformers(hf)) == 0.0          # transformers' default: off
    hf.config.output_router_logits, hf.config.router_aux_loss_coef = True, 0.25
    assert router_aux_loss_coef(lathe_from_transformers(hf)) == 0.25
    assert router_aux_loss_coef(hf) == 0.0                                   # transformers' modules: not lathe's
    dense = lathe_from_transformers(hf_model("qwen3"))
    with collect_router_stats(dense) as stats:
        assert stats is None and router_aux_loss_coef(dense) == 0.0


def test_megatron_router_losses_equal_their_formula_per_layer():
    """Megatron's switch loss and z-loss, written here from their formulas over each sparse layer's router logits
    (captured by hooks), summed over the layers: values and the routers' gradients."""
    from transformers import AutoModelForCausalLM

    from .lathe_tiny import hf_config
    cfg = hf_config(MOE)
    cfg.mlp_only_layers = []                                   # every layer sparse: the sum over layers matters
    torch.manual_seed(0)
    lathe = lathe_from_transformers(AutoModelForCausalLM.from_config(cfg)).train()
    blocks = [m for m in lathe.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == cfg.num_hidden_layers >= 2
    seen = []
    hooks = [b.gate.register_forward_hook(lambda mod, args, out: seen.append(out)) for b in blocks]
    with collect_router_stats(lathe, keep_logits=True) as stats:
        lathe(torch.randint(0, 100, (2, 9)))
    for h in hooks:
        h.remove()
    aux, z = stats.megatron_losses()
    e, k = lathe.config.moe.num_experts, lathe.config.moe.num_experts_per_tok
    want_aux = want_z = 0
    for logits in seen:
        t = logits.shape[0]
        probs = torch.softmax(logits.double(), -1)
        counts = torch.nn.functional.one_hot(probs.topk(k, -1).indices, e).sum((0, 1)).double()
        want_aux = want_aux + e / (k * t * t) * (probs.sum(0) * counts).sum()
        want_z = want_z + torch.logsumexp(logits.double(), -1).square().mean()
    assert_close_rel(aux, want_aux.float(), rel=1e-5, name="switch load-balancing loss")
    assert_close_rel(z, want_z.float(), rel=1e-5, name="z-loss")
    gates = [b.gate.weight for b in blocks]
    got = torch.autograd.grad(aux + 0.1 * z, gates, retain_graph=True)
    want = torch.autograd.grad((want_aux + 0.1 * want_z).float(), gates)
    assert_close_rel(torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in want]), rel=1e-4,
                     name="router gradients")
    assert megatron_router_coefs(lathe, 0.01, 0.0) == (0.01, 0.0) and megatron_router_coefs(lathe, 0, 0) is None
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        megatron_router_coefs(lathe_from_transformers(hf_model("qwen3")), 0.01, 0.001)


def test_grouped_matmul_equals_the_expert_loop(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(0)
    x, gate_up, down = torch.randn(11, 32, generator=gen), torch.randn(4, 32, 32, generator=gen), \
        torch.randn(4, 32, 16, generator=gen)
    weights, chosen = torch.rand(11, 2, generator=gen), torch.randint(0, 3, (11, 2), generator=gen)  # expert 3 idle
    loop = experts_forward(x, weights, chosen, gate_up, down)
    monkeypatch.setattr("lathe.models.moe.grouped_mm_supported", lambda *a: True)
    try:
        grouped = experts_forward(x, weights, chosen, gate_up, down)
    except RuntimeError as e:         # a torch without the CPU fallback of the grouped matmul
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {e}")
    assert_close_rel(grouped, loop, name="grouped experts")


def test_checkpoint_round_trip_through_transformers(tmp_path):
    path, _ = save_hf(tmp_path, MOE)
    names, arch = round_trip(path, tmp_path / "lathe", 100)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    assert arch == "Qwen3MoeForCausalLM"


def test_expert_layouts_convert_both_ways():
    hf = hf_model(MOE)
    fused = hf.state_dict()
    per_expert = split_expert_weights(fused)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in per_expert
    assert per_expert["model.layers.1.mlp.experts.2.up_proj.weight"].shape == (16, 32)
    back = fuse_expert_weights(per_expert)
    assert back.keys() == fused.keys() and all(torch.equal(back[k], fused[k]) for k in fused)
    del per_expert["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        fuse_expert_weights(per_expert)


def test_the_expert_loop_under_torch_compile_does_not_recompile_per_routing():
    """The loop reads each expert's row count on the host; compiled, each pattern of idle experts was a new graph
    (a GPU test hit dynamo's recompile limit in a float32 MoE): the loop runs eager inside compiled code."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(experts_forward, backend=counter)
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(6, 16, 8, generator=gen), torch.randn(6, 8, 8, generator=gen)
    x = torch.randn(5, 8, generator=gen)
    for i in range(12):                            # 12 routings, most with other experts idle
        weights, chosen = torch.rand(5, 2, generator=gen), torch.randint(0, 2 + i % 5, (5, 2), generator=gen)
        assert_close_rel(step(x, weights, chosen, gate_up, down), experts_forward(x, weights, chosen, gate_up, down),
                         name=f"routing {i}")
    assert counter.frame_count <= 4, f"{counter.frame_count} graphs compiled for 12 routings"
