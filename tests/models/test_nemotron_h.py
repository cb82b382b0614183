"""Nemotron-H (Mamba2, attention without RoPE, relu^2 MLP and MoE layers) in lathe's decoder against transformers'
`NemotronHForCausalLM`: logits on a ragged batch (padded and packed), gradients, the Hub's checkpoint names both
ways, its config spellings, and what is refused by name."""

import json

import pytest
import torch

pytest.importorskip("transformers.models.nemotron_h")

from lathe.models.config import LatheConfig, UnsupportedArchitecture  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402
from lathe.models.routing import record_routing, replay_routing  # noqa: E402

from helpers import assert_close_rel  # noqa: E402

from .lathe_tiny import ragged_batch  # noqa: E402
from .moe_reference import assert_gradients_equal_transformers, assert_logits_equal_transformers, \
    round_trip  # noqa: E402
from .nemotron_tiny import BLOCKS, VOCAB, nemotron_config, nemotron_model  # noqa: E402


@pytest.fixture(scope="module", params=["plain", "latent"])
def pair(request):
    hf = nemotron_model(moe_latent_size=12 if request.param == "latent" else None)
    return hf, lathe_from_transformers(hf).eval()


def test_config_reads_the_block_types_and_the_hub_spellings():
    d = nemotron_config().to_dict()
    d["architectures"] = ["NemotronHForCausalLM"]
    cfg = LatheConfig.from_hf_dict(d)
    assert cfg.nemotron.block_types == tuple(BLOCKS) and cfg.num_hidden_layers == 6
    assert [cfg.is_sparse_layer(i) for i in range(6)] == [t == "moe" for t in BLOCKS]
    assert (cfg.moe.scoring, cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == \
        ("sigmoid", 4, 2, 2.5)
    # the Hub's older config.json: a pattern string and the mamba_* spellings
    hub = {k: v for k, v in d.items() if k not in ("layers_block_type", "layer_types", "n_groups", "conv_kernel")}
    hub.update(hybrid_override_pattern="ME*-ME", mamba_n_groups=2, mamba_d_conv=3, mamba_dt_limit=[0.0, 5.0])
    cfg = LatheConfig.from_hf_dict(hub)
    assert cfg.nemotron.block_types == tuple(BLOCKS)
    m = cfg.nemotron.mamba
    assert (m.n_groups, m.conv_kernel, m.time_step_limit) == (2, 3, (0.0, 5.0))
    legacy = {**d, "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"]}
    assert LatheConfig.from_hf_dict(legacy).nemotron.block_types == tuple(BLOCKS)


def test_config_refuses_what_the_decoder_lacks():
    d = {**nemotron_config().to_dict(), "architectures": ["NemotronHForCausalLM"]}
    for key, value, words in (("mlp_hidden_act", "gelu", "mlp_hidden_act"), ("sliding_window", 8, "sliding_window"),
                              ("mamba_hidden_act", "gelu", "mamba_hidden_act")):
        with pytest.raises(UnsupportedArchitecture, match=words):
            LatheConfig.from_hf_dict({**d, key: value})
    with pytest.raises(ValueError, match="layers_block_type"):
        LatheConfig.from_hf_dict({**d, "layers_block_type": ["linear_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        LatheConfig.from_hf_dict({**{k: v for k, v in d.items() if k not in ("layers_block_type", "layer_types")},
                                  "hybrid_override_pattern": "M?"})


def test_padded_and_packed_logits_equal_transformers(pair):
    hf, lathe = pair
    assert [type(layer.mixer).__name__ for layer in lathe.model.layers] == [
        "Mamba2Mixer", "NemotronMoeBlock", "NemotronAttention", "NemotronMLP", "Mamba2Mixer", "NemotronMoeBlock"]
    assert_logits_equal_transformers(hf, lathe)


def test_gradients_equal_transformers(pair):
    hf, lathe = pair
    nonzero = ["model.layers.0.mixer." + n for n in ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias",
                                                      "norm.weight", "in_proj.weight")]
    nonzero += ["model.layers.1.mixer.experts.up_proj", "model.layers.1.mixer.gate.weight",
                "model.layers.1.mixer.shared_experts.up_proj.weight", "model.layers.2.mixer.q_proj.weight",
                "model.layers.3.mixer.up_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]
    if lathe.config.nemotron.moe_latent_size:
        nonzero += ["model.layers.1.mixer.fc1_latent_proj.weight", "model.layers.1.mixer.fc2_latent_proj.weight"]
    hf_names = {n.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm."): p
                for n, p in hf.named_parameters()}
    assert set(hf_names) == {n for n, _ in lathe.named_parameters()}
    renamed = _Renamed(hf, hf_names)
    assert_gradients_equal_transformers(renamed, lathe, tuple(nonzero), rel=1e-5)


class _Renamed(torch.nn.Module):
    """transformers' model under lathe's names for the embeddings and the final norm (the rest are the same)."""

    def __init__(self, hf, named):
        super().__init__()
        self.hf, self.named = hf, named

    def forward(self, **kwargs):
        return self.hf(**kwargs)

    def named_parameters(self, *args, **kwargs):
        return iter(self.named.items())

    def zero_grad(self, set_to_none: bool = True):
        self.hf.zero_grad(set_to_none)


def test_routing_replay_gives_the_same_choices(pair):
    _, lathe = pair
    ids, mask, pos = ragged_batch(2)
    with torch.no_grad(), record_routing(lathe) as chosen:
        ref = lathe(ids, mask, pos).logits
    assert len(chosen) == 2 and all(c and c[0].shape[-1] == 3 for c in chosen)
    with torch.no_grad(), replay_routing(lathe, torch.stack([c[0] for c in chosen], dim=1)):
        again = lathe(ids, mask, pos).logits
    assert torch.equal(again, ref)


@pytest.mark.parametrize("latent", [None, 12])
def test_checkpoint_round_trip_through_transformers(tmp_path, latent):
    from safetensors import safe_open
    hf = nemotron_model(seed=3, moe_latent_size=latent)
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        hub = set(f.keys())
    assert "backbone.embeddings.weight" in hub and "backbone.layers.1.mixer.experts.7.up_proj.weight" in hub
    names, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", VOCAB)
    assert names == hub and arch == "NemotronHForCausalLM"
    saved = json.loads((tmp_path / "lathe" / "config.json").read_text())
    assert saved["model_type"] == "nemotron_h"


def test_mtp_tensors_are_dropped_and_the_selection_bias_stays_float32(tmp_path):
    from safetensors.torch import load_file, save_file

    from lathe.models import load_lathe_model
    hf = nemotron_model(seed=4)
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["mtp.layers.0.norm.weight"] = torch.ones(32)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    lathe = load_lathe_model(tmp_path, dtype=torch.bfloat16)
    assert lathe.model.layers[1].mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert lathe.model.layers[1].mixer.gate.weight.dtype == torch.bfloat16


def test_a_critic_loads_the_policy_backbone_and_reads_back_its_own_save(tmp_path):
    """A value model from the causal LM's save (its head at zero), saved as lathe's NemotronHForTokenClassification
    under the Hub's backbone.* names, reads back the same values."""
    from .moe_reference import assert_critic_round_trip
    assert_critic_round_trip(nemotron_model(seed=8), tmp_path, VOCAB, "NemotronHForTokenClassification",
                             sparse=lambda layer: layer.mixer)


def test_unbuilt_layouts_are_refused_by_name():
    from lathe.models.attention import GroupedAttention
    lathe = lathe_from_transformers(nemotron_model())
    h = torch.zeros(5, 32)
    grouped = GroupedAttention.__new__(GroupedAttention)
    grouped.linear = None
    with pytest.raises(NotImplementedError, match="GroupedAttention without its GroupedLinear layout"):
        lathe.model.layers[0]._mamba(h, grouped)


@pytest.mark.parametrize("latent", [None, 12])
def test_engine_greedy_tokens_and_log_probs_equal_transformers(tmp_path, latent):
    """lathe's engine (paged KV for the attention layer, per-sequence Mamba2 states: prefill steps continue each
    sequence's states, decode steps advance them one token) against transformers' generate and lathe's own
    teacher-forced forward."""
    from lathe.models import load_lathe_model

    from .moe_reference import assert_engine_equals_transformers
    hf = nemotron_model(seed=5, moe_latent_size=latent)
    hf.save_pretrained(tmp_path)
    assert_engine_equals_transformers(hf, load_lathe_model(tmp_path).eval(), tmp_path, "nemotron_h")


@pytest.mark.gpu
@pytest.mark.parametrize("latent", [None, 12])
def test_bf16_packed_forward_and_gradients_on_cuda_follow_the_cpu_reference(latent):
    """On CUDA in bf16 (varlen attention, the experts as grouped matmuls on Hopper, the scan on fla's kernels where
    installed, its backward on them or on the torch form by `ssd._fla_takes`): logits and
    gradients near the float32 CPU path, the bf16 forward replaying the reference's expert choices (near ties that
    bf16 rounding flips are a discrete change the tolerance is not about)."""
    from lathe.models.packing import pack_padded
    hf = nemotron_model(moe_latent_size=latent)
    cpu = lathe_from_transformers(hf)
    low = lathe_from_transformers(hf).to("cuda", torch.bfloat16)
    packed = pack_padded(*ragged_batch(2))
    outs, seen = [], None
    for model in (cpu, low):
        dev = model.device
        args = (packed.input_ids.to(dev), packed.position_ids.to(dev), packed.cu_seqlens.to(dev), packed.max_seqlen)
        if seen is None:
            with record_routing(model) as recorded:
                logits = model.forward_packed(*args, return_hidden=False)
            seen = torch.stack([layer[0] for layer in recorded], dim=1)
        else:
            with replay_routing(model, seen.to(dev)):
                logits = model.forward_packed(*args, return_hidden=False)
        logits.float().pow(2).mean().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    assert_close_rel(outs[1][0], outs[0][0], rel=3e-2, name="bf16 logits")
    assert_close_rel(outs[1][1], outs[0][1], rel=1e-1, name="bf16 gradients")
