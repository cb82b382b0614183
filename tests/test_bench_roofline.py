"""bench/roofline.py's speed-of-light formulas against numbers worked out by hand for a made-up shape, and
bench/e2e.py's CPU smoke run writing the per-phase figures. The module is loaded by its path under a name of its own,
so nothing in the suite (tests/train, lathe) stands in for it or is shadowed by it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_roofline", ROOT / "bench" / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)

# 2 layers, hidden 64, 4 heads of 16 (q width 64), 2 kv heads (kv width 32), intermediate 128, vocab 1000, tied.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)


def test_parameter_and_byte_counts():
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 + gate/up/down 3*64*128 = 4096+4096+4096+24576 = 36864
    assert roofline.layer_matmul_params(SHAPE) == 73728
    # + biases (64+32+32) and two norms (64+64) per layer = 256 x 2, final norm 64, embedding 64000
    assert roofline.param_count(SHAPE) == 138304
    assert roofline.decode_weight_bytes(SHAPE) == 276608
    untied = {**SHAPE, "tie_word_embeddings": False}
    assert roofline.param_count(untied) == 202304
    assert roofline.decode_weight_bytes(untied) == 276608      # the untied embedding table is not read whole
    assert roofline.kv_bytes_per_token(SHAPE) == 256           # K,V x 2 layers x 32 x 2 bytes


# A made-up MoE shape: 2 layers, hidden 64, q width 64 (4 heads of 16), kv width 32, 8 experts of width 16, top 2.
MOE = {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16}


def test_moe_counts_the_active_experts_for_flops_and_decode_and_all_for_parameters():
    # per layer, a token: attention 12288 + 2 experts x 3*64*16 + router 64*8 = 12288 + 6144 + 512 = 18944
    assert roofline.layer_matmul_params(MOE) == 2 * 18944
    # all 8 experts 24576 + router 512 + q/k norms 2*16 + two norms 128, per layer; final norm 64, embedding 64000
    assert roofline.param_count(MOE) == 2 * (12288 + 24576 + 512 + 32 + 128) + 64 + 64000
    assert roofline.decode_weight_bytes(MOE) == 2 * (roofline.param_count(MOE) - 2 * 6 * 3 * 64 * 16)


def test_the_bench_shapes_count_what_lathe_builds():
    """bench/common.py's larger and MoE shapes: roofline.param_count against lathe's decoder on the meta device."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import common
    from lathe.models.config import LatheConfig
    from lathe.models.decoder import LatheCausalLM
    for name, rel in (("14b", 0), ("30b-a3b", 0), ("tiny-moe", 0), ("gpt-oss-20b", 1e-3)):   # GPT-OSS: biases out
        with torch.device("meta"):
            model = LatheCausalLM(LatheConfig.from_hf_dict(common.hf_config(name), source=name))
        real = sum(p.numel() for p in model.parameters())
        assert abs(roofline.param_count(common.SHAPES[name]) - real) <= rel * real, name


def test_sliding_layers_attend_to_their_window():
    slid = {**SHAPE, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    # the full layer: 2*2*64*16*17/2; the sliding one: 4*5/2 + 12*4 = 58 query-key pairs, x 4 x 64
    assert roofline.attention_flops(slid, 16) == 4 * 64 * 136 + 4 * 64 * 58


def test_flop_counts():
    assert roofline.attention_flops(SHAPE, 16) == 69632        # 2 x 2 x 2 layers x 64 x 16*17/2
    # prefill of 4 prompts of 16: 2*73728*64 + lm_head 2*64000*4 + 4*69632
    assert roofline.forward_flops(SHAPE, [16] * 4, 4) == 10227712
    assert roofline.prefill_seconds(SHAPE, 4, 16, 1e12) == pytest.approx(10227712e-12)
    # 8 sequences of 16 + 8: 2*73728*192 + 2*64000*64 (response rows) + 8 * 2*2*2*64*24*25/2
    assert roofline.log_prob_seconds(SHAPE, 8, 16, 8, 1e9) == pytest.approx(37732352e-9)
    assert roofline.update_seconds(SHAPE, 8, 16, 8, 1e9) == pytest.approx(3 * 37732352e-9)
    # recompute: the layers' forward once more, 28311552 + 1228800
    assert roofline.update_seconds(SHAPE, 8, 16, 8, 1e9, checkpointing=True) == pytest.approx(142737408e-9)


def test_decode_bound():
    # 8 sequences, prompt 16, 3 new tokens: decode steps at context 17 and 18 (the prefill gave the first token)
    # bytes: (276608 + 8*17*256) + (276608 + 8*18*256) = 311424 + 313472
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9) == pytest.approx(624896e-9)
    # FLOPs per sequence: 2*(73728 + 64000) + 4*2*64*ctx; x8 = 2273280 and 2277376, above the bytes at 1e9/s
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, 1e9) == pytest.approx(4550656e-9)
    # at most 3 at once: waves of 3, 3, 2, each 2 x 276608 weight bytes; KV 8 sequences x (17+18) x 256
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, max_num_seqs=3) == pytest.approx(1731328e-9)


def test_step_light_sums_phases_and_skips_cpu():
    measured = {"gen": 2.0, "update_actor": 4.0, "reward": 0.5}
    sol = roofline.step_light(SHAPE, "NVIDIA H200", prompts=4, n=2, prompt_len=16, response_len=8,
                              measured=measured, step_s=8.0, checkpointing=False)
    assert set(sol) == {"gen", "update_actor", "step", "rates"}
    gen = sol["gen"]
    assert gen["light_s"] == pytest.approx(gen["prefill_light_s"] + gen["decode_light_s"])
    assert gen["fraction"] == pytest.approx(gen["light_s"] / 2.0)
    assert sol["update_actor"]["light_s"] == pytest.approx(3 * 37732352 / 790e12)
    assert sol["step"]["light_s"] == pytest.approx(gen["light_s"] + sol["update_actor"]["light_s"])
    assert sol["step"]["fraction"] == pytest.approx(sol["step"]["light_s"] / 8.0)
    cpu = roofline.step_light(SHAPE, "cpu", prompts=4, n=2, prompt_len=16, response_len=8, measured=measured,
                              step_s=8.0, checkpointing=False)
    assert cpu["gen"] == {"measured_s": 2.0, "light_s": None, "fraction": None}
    assert cpu["step"]["light_s"] is None


def test_e2e_cpu_smoke_writes_speed_of_light(tmp_path):
    out = tmp_path / "e2e.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--device", "cpu", "--models", "tiny",
                           "--systems", "lathe", "--steps", "2", "--prompts", "4", "--n", "2", "--prompt-len", "16",
                           "--response-len", "8", "--out", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    model = json.loads(out.read_text())["models"]["tiny"]
    sol = model["lathe"]["speed_of_light"]
    assert {"gen", "update_actor", "step"} <= set(sol)
    for row in (sol["gen"], sol["update_actor"], sol["step"]):
        assert row["measured_s"] > 0 and row["light_s"] is None and row["fraction"] is None
    assert "speed-of-light" in model["what"]
