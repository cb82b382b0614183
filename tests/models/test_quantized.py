"""Quantised checkpoints read as unquantised weights (`lathe.models.quantized`): the block-FP8 format of DeepSeek-V3,
Kimi-K2 and Qwen3's FP8 checkpoints, compressed-tensors' FP8 and packed INT4 (Kimi-K2.6's experts). Each format is
written here from its definition (a per-block / per-group loop, a bit-by-bit packer), so the references are
independent of the code under test; a model loaded from a quantised checkpoint equals the one loaded from the
dequantised weights written plainly, and saves unquantised weights that transformers reads."""

from __future__ import annotations

import json

import pytest
import torch

from lathe.models import load_lathe_model
from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.quantized import Scheme, dequantize_fp8, dequantize_int4, scheme, unpack_int4

from .deepseek_tiny import VOCAB, deepseek_model

FP8_MAX = 448.0


def quantize_fp8_blocks(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 q, float32 scale_inv) with one scale per br x bc block (amax / 448), loop over blocks."""
    rows, cols = w.shape
    scales = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = block.abs().max().clamp(min=1e-12) / FP8_MAX
            scales[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (block / s).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8_blocks(q: torch.Tensor, scales: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    out = q.float().clone()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= scales[i, j].float()
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' packing from its definition: value q + 8 of element c of a row at bits 4 (c mod 8) of word
    c // 8 (int32, two's complement)."""
    rows, cols = q.shape
    words = [[0] * -(-cols // 8) for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            words[r][c // 8] |= (int(q[r, c]) + 8) << (4 * (c % 8))
    wrap = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words]
    return torch.tensor(wrap, dtype=torch.int32)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q in -8..7, scale (rows, cols / group)) symmetric, amax / 7 per group."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7).to(torch.int8).reshape(rows, cols)
    return q, scale.to(torch.bfloat16)


def test_fp8_blocks_dequantise_as_the_block_loop_says_partial_blocks_and_ue8m0_scales_included():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    q, s = quantize_fp8_blocks(w, 128, 128)
    ref = dequantize_fp8_blocks(q, s, 128, 128)
    assert torch.equal(dequantize_fp8(q, s, (128, 128), "w"), ref)
    assert torch.linalg.norm(ref - w) / torch.linalg.norm(w) < 0.05          # (e4m3's rounding)
    ue8m0 = torch.exp2(torch.ceil(torch.log2(s)))                          # DeepSeek-V3.1's power-of-two scales
    assert torch.equal(dequantize_fp8(q, ue8m0.to(torch.float8_e8m0fnu), (128, 128), "w"),
                       dequantize_fp8_blocks(q, ue8m0, 128, 128))
    with pytest.raises(ValueError, match=r"w: \(2, 2\) scales for a \(200, 300\) weight in 128x128 blocks"):
        dequantize_fp8(q, s[:, :2], (128, 128), "w")
    # compressed-tensors: one scale per row, or one for all
    per_row = torch.rand(200, 1) + 0.5
    assert torch.equal(dequantize_fp8(q, per_row, None, "w", per_row=True), q.float() * per_row)
    with pytest.raises(ValueError, match=r"w: a scale of shape \(200, 1\) for a weight of \(200, 300\) and no block"):
        dequantize_fp8(q, per_row, None, "w")
    assert torch.equal(dequantize_fp8(q, torch.tensor([0.25]), None, "w"), q.float() * 0.25)


def test_int4_unpacks_compressed_tensors_packing_and_scales_each_group():
    torch.manual_seed(1)
    w = torch.randn(6, 40)                      # 40 columns: five words, the last one full; groups of 8
    q, scale = quantize_int4(w, 8)
    packed = pack_int4(q)
    assert packed.shape == (6, 5)
    assert torch.equal(unpack_int4(packed, 6, 40, "w"), q)
    odd = q[:, :36]                             # a partial last word
    assert torch.equal(unpack_int4(pack_int4(odd), 6, 36, "w"), odd)
    got = dequantize_int4(packed, scale, torch.tensor([6, 40]), 8, "w")
    want = torch.stack([torch.stack([q[r, c].float() * scale[r, c // 8].float() for c in range(40)])
                        for r in range(6)])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"w.weight_packed: torch.int32 \(6, 5\) for a \[6, 48\] weight"):
        unpack_int4(packed, 6, 48, "w")
    per_row = scale[:, :1]                      # the channel strategy: one scale a row
    assert torch.equal(dequantize_int4(packed, per_row, torch.tensor([6, 40]), 0, "w"), q.float() * per_row.float())
    with pytest.raises(ValueError, match=r"w.weight_scale: \(6, 5\) for a \[6, 40\] weight in groups of 16; "
                                         r"expected \(6, 2\)"):
        dequantize_int4(packed, scale, torch.tensor([6, 40]), 16, "w")


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}


def int4_config(group: int) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group, "dynamic": False,
                                                      "actorder": None, "observer": "minmax"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}


def _write(path, config: dict, shards: list[dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path / name))
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _plain_checkpoint(tmp_path):
    """A tiny DeepSeek-V3 saved by lathe (per-expert tensors on disk, as the hub's checkpoints): (its config, its
    tensors)."""
    from safetensors.torch import load_file

    from lathe.models.hf import lathe_from_transformers
    lathe_from_transformers(deepseek_model()).save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    return config, load_file(str(tmp_path / "plain" / "model.safetensors"))


def _logits(path) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_lathe_model(path).eval()(ids).logits


FP8_CHANNEL_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized",
                      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                                "strategy": "channel", "dynamic": False},
                                                    "input_activations": {"num_bits": 8, "type": "float",
                                                                          "strategy": "token", "dynamic": True}}}}


@pytest.mark.parametrize("fmt", ["fp8 blocks", "fp8 channels", "int4 experts"])
def test_a_quantised_checkpoint_loads_as_its_dequantised_weights_and_saves_them_unquantised(tmp_path, fmt):
    """Block-FP8 (every projection but the router, embeddings and lm_head; each scale in the shard after its weight),
    compressed-tensors' FP8 with a scale per row, and Kimi-K2-Thinking's layout (the routed experts INT4 in groups,
    the rest bf16): the model equals the one loaded from the dequantised tensors written plainly; its save has no
    quantization_config and transformers reads it."""
    from transformers import AutoModelForCausalLM
    config, tensors = _plain_checkpoint(tmp_path)
    quantized_shards, plain = [{}, {}], {}
    for name, t in tensors.items():
        linear = name.endswith("_proj.weight") and t.dim() == 2
        if fmt == "fp8 blocks" and linear:
            q, s = quantize_fp8_blocks(t, 8, 8)
            base = name[:-len(".weight")]
            quantized_shards[0][name], quantized_shards[1][base + ".weight_scale_inv"] = q, s
            plain[name] = dequantize_fp8_blocks(q, s, 8, 8)
        elif fmt == "fp8 channels" and linear:         # (compressed-tensors' FP8-dynamic: one scale per row)
            scale = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            q = (t.float() / scale).to(torch.float8_e4m3fn)
            quantized_shards[0][name], quantized_shards[1][name[:-len(".weight")] + ".weight_scale"] = q, scale
            plain[name] = q.float() * scale
        elif fmt == "int4 experts" and linear and ".mlp.experts." in name:
            q, s = quantize_int4(t, 8)
            base = name[:-len(".weight")]
            quantized_shards[0][base + ".weight_packed"] = pack_int4(q)
            quantized_shards[1][base + ".weight_scale"] = s
            quantized_shards[1][base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
            plain[name] = q.float() * s.float().repeat_interleave(8, dim=-1)
        else:
            quantized_shards[0][name] = plain[name] = t
    qconfig = {"fp8 blocks": FP8_CONFIG, "fp8 channels": FP8_CHANNEL_CONFIG, "int4 experts": int4_config(8)}[fmt]
    _write(tmp_path / "quantized", {**config, "quantization_config": qconfig}, quantized_shards)
    _write(tmp_path / "dequantized", config, [plain])
    assert LatheConfig.from_pretrained(tmp_path / "quantized").architecture == "DeepseekV3ForCausalLM"
    ref = _logits(tmp_path / "dequantized")
    assert not torch.equal(ref, _logits(tmp_path / "plain"))      # (the quantisation's rounding shows)
    assert torch.equal(_logits(tmp_path / "quantized"), ref)
    model = load_lathe_model(tmp_path / "quantized")
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in saved
    assert torch.equal(_logits(tmp_path / "saved"), ref)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_a_weight_without_its_scale_fails_naming_it(tmp_path):
    config, tensors = _plain_checkpoint(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    q, _ = quantize_fp8_blocks(tensors[name], 8, 8)
    _write(tmp_path / "broken", {**config, "quantization_config": FP8_CONFIG}, [{**tensors, name: q}])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj has model.layers.0.mlp.down_proj.weight but "
                                         r"not all the parts of FP8 weights, 8x8 blocks"):
        load_lathe_model(tmp_path / "broken")


@pytest.mark.parametrize("qconfig, match", [
    ({**FP8_CONFIG, "activation_scheme": "static"}, r"activation_scheme='static' \(static activation scales\)"),
    ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes'"),
    ({"quant_method": "mxfp4"}, r"mxfp4.*Mxfp4Config\(dequantize=True\)"),
    ({**int4_config(8), "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                            "strategy": "group", "group_size": 8}}}},
     r"config_groups.g.weights=.*symmetric': False"),
    ({**int4_config(8), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                            "strategy": "channel"}}}},
     r"config_groups.g is 'pack-quantized' with weights"),
    ({**int4_config(8), "config_groups": {"g": {**int4_config(8)["config_groups"]["group_0"],
                                                "input_activations": {"num_bits": 8, "dynamic": False}}}},
     r"input_activations quantises activations with stored scales"),
])
def test_schemes_lathe_does_not_read_are_refused_naming_the_key(qconfig, match):
    d = {**deepseek_model().config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"],
         "quantization_config": qconfig}
    with pytest.raises(UnsupportedArchitecture, match=match):
        LatheConfig.from_hf_dict(d, source="config.json")


def test_schemes_read():
    assert scheme({"quantization_config": FP8_CONFIG}, "c") == Scheme("fp8", (8, 8))
    assert scheme({"quantization_config": {"quant_method": "fp8"}}, "c") == Scheme("fp8", None)
    assert scheme({"quantization_config": int4_config(32)}, "c") == Scheme("int4", group_size=32)
    channel = {**int4_config(32), "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                      "strategy": "channel"}}}}
    assert scheme({"quantization_config": channel}, "c") == Scheme("int4")
    fp8_dynamic = {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                             "strategy": "channel", "dynamic": False},
                                                 "input_activations": {"num_bits": 8, "type": "float",
                                                                       "strategy": "token", "dynamic": True}}}}
    assert scheme({"quantization_config": fp8_dynamic}, "c") == Scheme("fp8-ct")
    weights = fp8_dynamic["config_groups"]["group_0"]["weights"]
    blocks = {**fp8_dynamic, "config_groups": {"g": {"weights": {**weights, "strategy": "block",
                                                                 "block_structure": [128, 128]}}}}
    assert scheme({"quantization_config": blocks}, "c") == Scheme("fp8-ct", (128, 128))
    assert scheme({}, "c") is None


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_dense_moe_and_hybrid_configs_take_the_schemes_too(family):
    from .lathe_tiny import hf_config
    d = {**hf_config(family).to_dict(), "quantization_config": FP8_CONFIG}
    d["architectures"] = [type(hf_config(family)).__name__.replace("Config", "ForCausalLM")]
    assert LatheConfig.from_hf_dict(d).architecture == d["architectures"][0]
    with pytest.raises(UnsupportedArchitecture, match="quant_method='awq'"):
        LatheConfig.from_hf_dict({**d, "quantization_config": {"quant_method": "awq"}})


def test_a_vision_language_checkpoint_in_fp8_loads_dequantised_and_saves_unquantised(tmp_path):
    """Qwen2.5-VL with its language model's projections in FP8 blocks (the vision tower bf16, as the hub's `-FP8`
    checkpoints keep it): lathe's VL model equals the one loaded from the dequantised weights; its save (the whole
    VL checkpoint) drops quantization_config and transformers reads it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from lathe.models import load_lathe_vl_model

    from .vl_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen2_5_vl")
    config = json.loads((path / "config.json").read_text())
    quantized_shards, plain = [{}, {}], {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name.endswith("_proj.weight") and t.dim() == 2 and "visual" not in name:
            q, s = quantize_fp8_blocks(t, 16, 16)
            quantized_shards[0][name], quantized_shards[1][name[:-len(".weight")] + ".weight_scale_inv"] = q, s
            plain[name] = dequantize_fp8_blocks(q, s, 16, 16).to(t.dtype)
        else:
            quantized_shards[0][name] = plain[name] = t
    _write(tmp_path / "quantized", {**config, "quantization_config": {**FP8_CONFIG, "weight_block_size": [16, 16]}},
           quantized_shards)
    _write(tmp_path / "dequantized", config, [plain])
    model = load_lathe_vl_model(tmp_path / "quantized")
    want = load_lathe_vl_model(tmp_path / "dequantized").state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved")
    assert torch.equal(back.state_dict()["model.language_model.layers.0.mlp.down_proj.weight"],
                       want["model.language_model.layers.0.mlp.down_proj.weight"].to(back.dtype))
