"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (hybrid gated-DeltaNet / gated full attention) in lathe's decoder against
transformers: logits on a ragged batch (padded and packed), gradients, the load-balancing loss, and checkpoints
both ways."""

import contextlib

import pytest
import torch

from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.hf import lathe_from_transformers
from lathe.models.moe import collect_router_stats, sparse_blocks
from lathe.models.packing import pack_padded
from lathe.models.routing import record_routing, replay_routing

from helpers import assert_close_rel

from .lathe_tiny import HYBRIDS, VOCAB, hf_model, ragged_batch
from .moe_reference import assert_logits_equal_transformers, round_trip


@pytest.fixture(scope="module", params=HYBRIDS)
def pair(request):
    hf = hf_model(request.param)
    return hf, lathe_from_transformers(hf).eval()


def test_padded_and_packed_logits_equal_transformers(pair):
    hf, lathe = pair
    assert [hasattr(layer, "linear_attn") for layer in lathe.model.layers] == [True, False]
    assert_logits_equal_transformers(hf, lathe)


def test_gradients_and_aux_loss_equal_transformers(pair):
    hf, lathe = pair
    ids, mask, pos = ragged_batch(1)
    real = mask.bool()
    moe = lathe.config.moe is not None
    hf.zero_grad()
    out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=moe)
    ref_aux = out.aux_loss if moe else torch.zeros(())
    (out.logits[real].pow(2).mean() + 10.0 * ref_aux).backward()
    packed = pack_padded(ids, mask, pos)
    lathe.zero_grad()
    with collect_router_stats(lathe) as stats:
        logits = lathe.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                      return_hidden=False)
    aux = stats.aux_loss() if moe else torch.zeros(())
    assert_close_rel(aux, ref_aux, name="load-balancing loss")
    (logits.pow(2).mean() + 10.0 * aux).backward()
    grads = {n: p.grad for n, p in lathe.named_parameters()}
    ref = {n: p.grad for n, p in hf.named_parameters() if n in grads}
    assert set(ref) == set(grads) and all(g is not None for g in grads.values())
    for name in ("A_log", "dt_bias", "conv1d.weight", "norm.weight"):
        assert grads[f"model.layers.0.linear_attn.{name}"].abs().sum() > 0
    assert_close_rel(grads, ref, rel=1e-4, name="gradients")


@pytest.mark.parametrize("family", HYBRIDS)
def test_checkpoint_round_trip_through_transformers(tmp_path, family):
    from safetensors import safe_open
    hf = hf_model(family, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    names, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", VOCAB)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())                    # the same tensor names (and expert layout) as transformers
    assert arch == type(hf).__name__


def test_configs_outside_the_hybrid_layers_fall_back():
    d = hf_model("qwen3_5_text").config.to_dict()
    d["architectures"] = ["Qwen3_5ForCausalLM"]
    assert LatheConfig.from_hf_dict(d).rotary_dim == 4
    for key, value, words in (("layer_types", ["linear_attention", "sliding_attention"], "layer_types"),
                              ("hidden_act", "gelu", "hidden_act")):
        with pytest.raises((UnsupportedArchitecture, ValueError), match=words):
            LatheConfig.from_hf_dict({**d, key: value})


def test_a_grouped_stream_without_its_linear_layout_is_refused_by_name():
    """Prefix-grouped rows need the stream's layout for linear-attention layers (`GroupedLinear`, which
    `lathe.train.prefix_group.grouped_layout` builds for a model with them: tests/train/test_prefix_group.py); a
    grouped attention without one is refused, not run as a packed stream (Ulysses and tensor parallelism in training
    split the layers by heads: tests/train/test_ulysses_hybrid.py, test_tensor_parallel_hybrid.py; the engine's
    tensor-parallel replicas too: tests/engine/test_tensor_parallel.py)."""
    lathe = lathe_from_transformers(hf_model("qwen3_5_text"))
    ids = torch.randint(0, 100, (1, 5))
    with pytest.raises(NotImplementedError, match="GroupedAttention without one"):
        lathe.hidden_grouped(ids[0], torch.arange(5), _one_segment(5))


@pytest.mark.gpu
@pytest.mark.parametrize("family", HYBRIDS)
def test_bf16_packed_forward_and_gradients_on_cuda_follow_the_cpu_reference(family):
    """On CUDA (fla's kernels when installed, varlen attention), bf16: logits and gradients near the fp32 CPU path.
    The MoE family's bf16 forward replays the reference's expert choices: in a tiny random model some tokens' top-k
    are near ties that bf16 rounding flips (5.7% logits error on an H200, the same before the decode kernels), a
    discrete change the tolerance is not about."""
    bf16_follows_the_reference(family, torch.device("cuda"))


def bf16_follows_the_reference(family: str, device: torch.device) -> None:
    hf = hf_model(family)
    cpu = lathe_from_transformers(hf)
    low = lathe_from_transformers(hf).to(device, torch.bfloat16)
    ids, mask, pos = ragged_batch(2)
    packed = pack_padded(ids, mask, pos)
    outs, seen = [], []
    for model in (cpu, low):
        dev = model.device
        if not sparse_blocks(model):
            routing = contextlib.nullcontext()
        elif model is cpu:
            routing = record_routing(model)
        else:
            routing = replay_routing(model, torch.stack([layer[0] for layer in seen], dim=1).to(dev))
        with routing as recorded:
            logits = model.forward_packed(packed.input_ids.to(dev), packed.position_ids.to(dev),
                                          packed.cu_seqlens.to(dev), packed.max_seqlen, return_hidden=False)
        seen = recorded or []
        logits.float().pow(2).mean().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    assert_close_rel(outs[1][0], outs[0][0], rel=3e-2, name="bf16 logits")
    assert_close_rel(outs[1][1], outs[0][1], rel=1e-1, name="bf16 gradients")


def _one_segment(n: int):
    """A prefix-grouped forward's attention over one causal segment of n tokens."""
    from lathe.models.attention import GroupedAttention
    cu = torch.tensor([0, n], dtype=torch.int32)
    return GroupedAttention(cu, cu, torch.arange(n), n, n)
