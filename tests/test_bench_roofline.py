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
    # (GPT-OSS: its biases are not counted, 1e-3)
    for name, rel in (("14b", 0), ("30b-a3b", 0), ("tiny-moe", 0), ("gpt-oss-20b", 1e-3), ("gpt-oss-20b-8l", 1e-3),
                      ("qwen3.5-2b", 0), ("qwen3.5-35b-a3b", 0), ("qwen3.5-35b-a3b-12l", 0), ("tiny-qwen3.5", 0),
                      ("nemotron-nano", 0), ("nemotron-nano-8l", 0), ("tiny-nemotron", 0)):
        with torch.device("meta"):
            model = LatheCausalLM(LatheConfig.from_hf_dict(common.hf_config(name), source=name))
        real = sum(p.numel() for p in model.parameters())
        assert abs(roofline.param_count(common.SHAPES[name]) - real) <= rel * real, name


def test_nemotron_blocks_count_their_own_matrices_states_and_only_the_attention_kv():
    """Nemotron-3-Nano's shape: 31.6B parameters and 3.2B read per decode step without the embedding (the model
    card's 31.6B and 3.2B active); a made-up one: Mamba2, MoE, attention, MLP blocks."""
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    nano = common.SHAPES["nemotron-nano"]
    assert round(roofline.param_count(nano) / 1e9, 1) == 31.6
    assert round(roofline.decode_weight_bytes(nano) / 2 / 1e9, 1) == 3.2
    # hidden 64; Mamba2 4 heads of 8 (inner 32), 2 groups of B, C of 4 (8 each), kernel 4; attention 4 heads of 16,
    # 2 kv heads; MLP 128; MoE 8 experts of 16 top-2, shared 32, no latent; vocab 1000 untied
    shape = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False,
             "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "mamba_num_heads": 4,
             "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 4, "conv_kernel": 4, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 32}
    mamba = 64 * (2 * 32 + 2 * 8 + 4) + 32 * 64                         # in_proj (z, x, B, C, dt) + out_proj
    moe = lambda k: 64 * 8 + k * 2 * 64 * 16 + 2 * 64 * 32              # noqa: E731  router, experts, shared
    attention, mlp = 2 * 64 * 64 + 2 * 64 * 32, 2 * 64 * 128
    assert roofline.layer_matmul_params(shape) == mamba + moe(2) + attention + mlp
    vectors = 4 * 64 + (32 + 16) * 5 + 3 * 4 + 32       # norms; conv weight + bias, dt_bias, A_log, D, gated norm
    assert roofline.param_count(shape) == mamba + moe(8) + attention + mlp + vectors + 64 + 2 * 1000 * 64
    assert roofline.decode_weight_bytes(shape) == 2 * (roofline.param_count(shape) - 64000 - 6 * 2 * 64 * 16)
    assert roofline.kv_bytes_per_token(shape) == 2 * 1 * 32 * 2             # the attention block's K and V only
    assert roofline.linear_state_bytes(shape) == 32 * 4 * 4 + 48 * 3 * 2    # H P N float32 + conv inputs (K - 1)


# A made-up hybrid: layers linear, full; hidden 64, 4 heads of 16 (q 64), 2 kv heads (kv 32); linear attention 2 key
# heads and 4 value heads of 8 (key width 16, value width 32, conv width 2*16+32 = 64), kernel 4; vocab 1000, tied.
HYBRID = {**SHAPE, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}


def test_hybrid_layers_count_their_projections_states_and_only_the_full_layers_kv():
    # linear: h*(conv 64 + value 32 + 2*4) + 32*h = 6656 + 2048; full: gated q 2*64*64 + 2*64*32 + 64*64 = 16384;
    # each + MLP 24576
    assert roofline.layer_matmul_params(HYBRID) == 8704 + 16384 + 2 * 24576
    # + conv 64*4, dt_bias and A_log 2*4, gated norm 8 (linear); q/k norms 2*16 (full); norms 2*64 each; final 64
    assert roofline.param_count(HYBRID) == 8704 + 16384 + 2 * 24576 + 256 + 8 + 8 + 32 + 2 * 128 + 64 + 64000
    assert roofline.kv_bytes_per_token(HYBRID) == 2 * 32 * 2          # the full layer's K, V only
    # the linear layer's state, read and written: 4 value heads x 8 x 8 float32 + conv 64 x 3 bf16
    assert roofline.linear_state_bytes(HYBRID) == 2 * (4 * 8 * 8 * 4 + 64 * 3 * 2)
    assert roofline.linear_state_bytes(SHAPE) == 0
    # decode at context 17: weights + 8 sequences x (17 tokens' K,V in one layer + their states)
    one_step = roofline.decode_weight_bytes(HYBRID) + 8 * (17 * 128 + roofline.linear_state_bytes(HYBRID))
    assert roofline.decode_seconds(HYBRID, 8, 16, 2, 1e9) == pytest.approx(one_step * 1e-9)


def test_expected_distinct_experts():
    import itertools
    assert roofline.expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert roofline.expected_distinct_experts(128, 8, 256) == pytest.approx(128, rel=1e-6)
    # 2 rows choosing 2 of 4: the mean over every pair of choices
    choices = list(itertools.combinations(range(4), 2))
    mean = sum(len(set(a) | set(b)) for a in choices for b in choices) / len(choices) ** 2
    assert roofline.expected_distinct_experts(4, 2, 2) == pytest.approx(mean) == pytest.approx(3.0)


def test_touched_bytes_lie_between_the_active_and_all_experts_and_equal_a_dense_shapes():
    assert roofline.touched_weight_bytes(MOE, 1) == roofline.decode_weight_bytes(MOE)
    every_expert = 2 * roofline.param_count(MOE)        # every parameter (the tied embedding: read as the lm_head)
    assert roofline.touched_weight_bytes(MOE, 10_000) == pytest.approx(every_expert)
    assert roofline.decode_weight_bytes(MOE) < roofline.touched_weight_bytes(MOE, 3) < every_expert
    for rows in (1, 256):
        assert roofline.touched_weight_bytes(SHAPE, rows) == roofline.decode_weight_bytes(SHAPE)
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, touched=True) == roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9)


def test_rollout_roofline_touched_equals_active_for_a_dense_shape_and_reads_the_linear_states():
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    lens = dict(prompt_lens=[16] * 8, out_lens=[4] * 8, bandwidth=1e9)
    dense = common.roofline_tok_s(SHAPE, 276608, **lens)
    assert common.roofline_tok_s(SHAPE, 276608, touched=True, **lens) == dense
    # 4 steps of 8 rows at contexts 16..19: weights + K,V (256 bytes a token) + nothing else
    assert dense == pytest.approx(32 / ((4 * 276608 + 8 * (16 + 17 + 18 + 19) * 256) * 1e-9))
    moe_w = roofline.decode_weight_bytes(MOE)
    assert common.roofline_tok_s(MOE, moe_w, touched=True, **lens) < common.roofline_tok_s(MOE, moe_w, **lens)
    hybrid_w = roofline.decode_weight_bytes(HYBRID)
    state = 4 * 8 * roofline.linear_state_bytes(HYBRID)                 # 4 steps x 8 rows
    assert common.roofline_tok_s(HYBRID, hybrid_w, **lens) == pytest.approx(
        32 / ((4 * hybrid_w + 8 * 70 * 128 + state) * 1e-9))


def test_step_light_reports_the_touched_bound_and_the_active_ceiling():
    measured = {"gen": 2.0, "update_actor": 4.0}
    kw = dict(prompts=4, n=64, prompt_len=16, response_len=8, measured=measured, step_s=8.0, checkpointing=False)
    dense = roofline.step_light(SHAPE, "NVIDIA H200", **kw)
    assert dense["gen"]["touched_light_s"] == dense["gen"]["light_s"]
    assert dense["gen"]["active_fraction_ceiling"] == 1.0
    assert dense["step"]["touched_fraction"] == dense["step"]["fraction"]
    moe = roofline.step_light(MOE, "NVIDIA H200", **kw)["gen"]
    assert moe["touched_light_s"] > moe["light_s"]
    assert moe["active_fraction_ceiling"] == pytest.approx(moe["light_s"] / moe["touched_light_s"])
    assert moe["touched_fraction"] == pytest.approx(moe["touched_light_s"] / 2.0)


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


def test_prefix_grouped_passes_count_each_prompt_once():
    # 2 prompts x 2 responses, prompt 16, response 8: tokens 2 x (16 + 2 x 8) = 64 -> 2*73728*64; lm_head 32 rows;
    # attention pairs a group: 16*17/2 + 2 x (8*16 + 8*9/2) = 464, x 4 x 64 x 2 layers x 2 groups
    assert roofline.grouped_forward_flops(SHAPE, 2, 2, 16, 8, 32) == 9437184 + 4096000 + 475136
    for n in (1, 3):       # one response a prompt: the per-row forward; more: less than the per-row forward
        grouped = roofline.grouped_forward_flops(SHAPE, 2, n, 16, 8, 5)
        per_row = roofline.forward_flops(SHAPE, [24] * (2 * n), 5)
        assert grouped == per_row if n == 1 else grouped < per_row
    assert roofline.update_seconds(SHAPE, 4, 16, 8, 1e9, n=2) == pytest.approx(
        3 * roofline.grouped_forward_flops(SHAPE, 2, 2, 16, 8, 32) / 1e9)
    sol = roofline.step_light(SHAPE, "NVIDIA H200", prompts=2, n=2, prompt_len=16, response_len=8,
                              measured={"update_actor": 1.0, "ref": 1.0}, step_s=3.0, checkpointing=False,
                              grouped=True)
    assert sol["grouped"] and sol["ref"]["light_s"] == pytest.approx(roofline.log_prob_seconds(SHAPE, 4, 16, 8,
                                                                                                790e12, 2))
    windowed = {**SHAPE, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    for n in (1, 3):       # GPT-OSS's sliding layers: each query over its window, the grouped prompt's keys included
        grouped = roofline.grouped_forward_flops(windowed, 2, n, 16, 8, 5)
        per_row = roofline.forward_flops(windowed, [24] * (2 * n), 5)
        assert grouped == per_row if n == 1 else grouped < per_row
    for n in (1, 3):       # Qwen3.5's linear layers: their state work on each token computed, a prompt's once
        grouped = roofline.grouped_forward_flops(HYBRID, 2, n, 16, 8, 5)
        per_row = roofline.forward_flops(HYBRID, [24] * (2 * n), 5)
        assert grouped == per_row if n == 1 else grouped < per_row
    e2e = _e2e()
    assert "; ref 0.0%, update_actor 0.0%)" in e2e.what("tiny", {"lathe": {"step_s": 3.0, "speed_of_light": sol}})
    assert e2e.kept_going("summary", lambda: {}["x"], lambda err: f"no summary ({err})") == "no summary (KeyError: 'x')"
    assert e2e.prefix_grouped(["x", "actor_rollout_ref.actor.use_prefix_grouper=true"])
    assert not e2e.prefix_grouped(["actor_rollout_ref.actor.use_prefix_grouper=true",
                                   "actor_rollout_ref.actor.use_prefix_grouper=false"])


def test_decode_bound():
    # 8 sequences, prompt 16, 3 new tokens: decode steps at context 17 and 18 (the prefill gave the first token)
    # bytes: (276608 + 8*17*256) + (276608 + 8*18*256) = 311424 + 313472
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9) == pytest.approx(624896e-9)
    # FLOPs per sequence: 2*(73728 + 64000) + 4*2*64*ctx; x8 = 2273280 and 2277376, above the bytes at 1e9/s
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, 1e9) == pytest.approx(4550656e-9)
    # at most 3 at once: waves of 3, 3, 2, each 2 x 276608 weight bytes; KV 8 sequences x (17+18) x 256
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, max_num_seqs=3) == pytest.approx(1731328e-9)


def test_decode_bound_reads_a_shared_prompt_once_per_group():
    # 8 sequences, prompt 16, 3 new tokens, groups of 4: each step saves (8 - 2) x 16 x 256 prompt bytes
    plain = roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9)
    assert roofline.decode_seconds(SHAPE, 8, 16, 3, 1e9, shared_rows=4) == pytest.approx(plain - 2 * 6 * 16 * 256e-9)
    e2e = _e2e()
    args = e2e.argparse.Namespace(prompt_len=2048, n=8)
    assert e2e.shared_prompt_rows("1.5b", ["x"], args) == 8            # 12 heads over 2: groups of 8
    assert e2e.shared_prompt_rows("7b", ["x"], e2e.argparse.Namespace(prompt_len=512, n=8)) == 8   # 512-wide K/V
    assert e2e.shared_prompt_rows("1.5b", ["x"], e2e.argparse.Namespace(prompt_len=512, n=8)) == 1  # below 768
    assert e2e.shared_prompt_rows("1.5b", ["actor_rollout_ref.rollout.shared_prefix_attention=false"], args) == 1
    assert e2e.shared_prompt_rows("1.5b", ["actor_rollout_ref.rollout.kv_cache_dtype=fp8"], args) == 1
    assert e2e.shared_prompt_rows("gpt-oss-20b", ["x"], args) == 1


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


def _e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_bound_counts_the_runs_own_recomputation(tmp_path):
    e2e = _e2e()
    on = "actor_rollout_ref.model.enable_gradient_checkpointing="
    assert e2e.recomputed("7b", ["x=1", on + "true"]) == 1.0
    assert e2e.recomputed("7b", [on + "true", "actor_rollout_ref.model.gradient_checkpointing_layers=14"]) == 0.5
    assert e2e.recomputed("7b", [on + "true", on + "false"]) == 0.0       # the last word wins, as in lathe's CLI
    # a result written with the bound counting recomputation the run's command turned off: --relight re-derives it
    workload = dict(prompts=4, n=2, prompt_len=16, response_len=8, extra=[on + "false"], gpus=1, teacher=None)
    row = {"command": f"-m lathe train base {on}true {on}false", "step_s": 1.0,
           "phases_s": {"gen": 0.3, "update_actor": 0.6}}
    args = e2e.argparse.Namespace(**workload)
    fixed = e2e.speed_of_light("0.5b", row, args, device="NVIDIA H200")
    wrong = roofline.step_light(e2e.SHAPES["0.5b"], "NVIDIA H200", prompts=4, n=2, prompt_len=16, response_len=8,
                                measured=row["phases_s"], step_s=1.0, checkpointing=True)
    assert wrong["update_actor"]["light_s"] > fixed["update_actor"]["light_s"]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "workload": workload,
                                "models": {"0.5b": {"lathe": {**row, "speed_of_light": wrong}}}}))
    assert len(e2e.relight(path, "why")) == 1
    lathe = json.loads(path.read_text())["models"]["0.5b"]["lathe"]
    assert lathe["speed_of_light"]["update_actor"]["light_s"] == pytest.approx(fixed["update_actor"]["light_s"])
    assert lathe["speed_of_light_rederived"] == {"note": "why", "step_fraction_as_written": wrong["step"]["fraction"],
                                                 "step_light_s_as_written": wrong["step"]["light_s"]}
    assert e2e.relight(path, "again") == []                                 # a right bound is left as it is
