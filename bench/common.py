"""What the benchmarks share: the model shapes, where a result comes from (device, commit), the device's datasheet
figures, the random-weight workloads, and running `lathe train` / `lathe sft` in a child process as a user does.

Named `common` (not after a bench) so that putting bench/ on `sys.path` cannot shadow a test package or `lathe`'s own.
Each bench does `sys.path.insert(0, bench/)` and `from common import ...`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
# bench/ is on the path (`common` was found there); kv_bytes_per_token is also the benches' through `common`
from roofline import (decode_weight_bytes, forward_flops, kv_bytes_per_token, linear_state_bytes,  # noqa: F401
                      param_count, touched_weight_bytes)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from lathe.models.rope import cast_keeping_rope  # noqa: E402  (build_hf's; bench/rm.py's too, through `common`)

QWEN_VOCAB = 151936
SHAPES = {   # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
# Mixture-of-experts shapes (issue 44's figures), with the transformers model type that builds them (`hf_config`):
# Qwen3-30B-A3B, the same with 12 of its 48 layers (7.7B: GRPO on 2 GPUs) or 6 (4.4B: one H200, or an H100 with the
# AdamW moments offloaded), GPT-OSS-20B (its alternating 128-token sliding windows, attention sinks and MXFP4-free bf16
# experts), and a tiny Qwen3-MoE for CPU smoke runs.
_QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, vocab_size=QWEN_VOCAB, tie_word_embeddings=False)
_GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_experts=32,
                    num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, vocab_size=201088, tie_word_embeddings=False, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"] * 12)
SHAPES.update({
    "30b-a3b": _QWEN3_30B_A3B,
    "30b-a3b-12l": {**_QWEN3_30B_A3B, "num_hidden_layers": 12},
    "30b-a3b-6l": {**_QWEN3_30B_A3B, "num_hidden_layers": 6},
    "gpt-oss-20b": _GPT_OSS_20B,
    # 8 of its 24 layers (about 8B): an A/B of both arms fits one device call
    "gpt-oss-20b-8l": {**_GPT_OSS_20B, "num_hidden_layers": 8,
                       "layer_types": ["sliding_attention", "full_attention"] * 4},
    # 4 of GPT-OSS-20B's layers: the step-1 kl_loss probe (bench/moe_kl_probe.py, e2e_kl_step1_oss4_*)
    "gpt-oss-20b-4l": {**_GPT_OSS_20B, "num_hidden_layers": 4,
                       "layer_types": ["sliding_attention", "full_attention"] * 2},
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=1024, tie_word_embeddings=False, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"] * 2),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True),
})


def hybrid_layers(n: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layer pattern: every `interval`-th layer full attention, the others gated DeltaNet (transformers'
    `full_attention_interval` default, 4; written out so that bench/roofline.py, which reads only the shape, sees it)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# Qwen3.5 hybrids (transformers' text-only `qwen3_5_text` / `qwen3_5_moe_text`, which Qwen3_5ForCausalLM and
# Qwen3_5MoeForCausalLM build): gated-DeltaNet layers with gated full attention every 4th layer (head_dim 256, a
# query and an output gate per head, RoPE on a quarter of each head), vocabulary 248320.
# - Qwen3.5-35B-A3B: every figure is transformers' Qwen3_5MoeTextConfig default (its docstring: "Qwen3.5-35B-A3B
#   style") and matches slime's scripts/models/qwen3.5-35B-A3B.sh: 40 layers, hidden 2048, 16 heads / 2 KV heads,
#   256 experts of 512 top-8 plus a shared expert of 512, linear attention 16 key / 32 value heads of 128, untied.
# - Qwen3.5-2B: layers 24, hidden 2048, intermediate 6144, 8 heads / 2 KV heads of 256, tied embeddings (no
#   untie flag) from slime-derived scripts/models/qwen3.5-2B.sh (YuancongLiang/slime-mopd, williammtan/miles).
#   GUESSED: its linear-attention heads (16 key and 16 value heads of 128): those scripts do not give them, and
#   transformers' defaults (16 / 32) are the 9B's.
# - the 35B-A3B cut to 12 of its 40 layers (9 linear, 3 full: the same pattern; 11.1B parameters), for GRPO on 2
#   GPUs; and to 8 (7.9B, about the size of 30b-a3b-12l, which fits 2 H200s) should 12 not fit.
# The rope (theta 1e7, partial factor 0.25) is the published models'; it changes no speed.
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
_QWEN35_35B_A3B = dict(model_type="qwen3_5_moe_text", hidden_size=2048, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                       num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=hybrid_layers(40),
                       vocab_size=248320, tie_word_embeddings=False)
SHAPES.update({
    "qwen3.5-2b": dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, layer_types=hybrid_layers(24), vocab_size=248320,
                       tie_word_embeddings=True),
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
    "qwen3.5-35b-a3b-12l": {**_QWEN35_35B_A3B, "num_hidden_layers": 12, "layer_types": hybrid_layers(12)},
    "qwen3.5-35b-a3b-8l": {**_QWEN35_35B_A3B, "num_hidden_layers": 8, "layer_types": hybrid_layers(8)},
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4, layer_types=hybrid_layers(4), vocab_size=1000,
                         tie_word_embeddings=True),
})
# Nemotron-H (`nemotron_h`): NVIDIA-Nemotron-3-Nano-30B-A3B's shape as its config.json gives it, from memory (the hub
# is out of reach here; its count, 31.6B parameters, 3.6B active with the embeddings, is the model card's): 52
# layers "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME" (23 Mamba2, 23 MoE, 6 attention), hidden 2688,
# 64 Mamba2 heads of 64 with 8 groups of B and C of 128, 32 query / 2 key-value heads of 128, 128 non-gated relu^2
# experts of 1856 top-6 (routed scale 2.5) plus a shared one of 3712, no latent projections, vocabulary 131072,
# untied. Cut to its first 8 layers "MEMEM*EM" (4 Mamba2, 3 MoE, 1 attention; 4.8B): one GPU's GRPO step.
_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_NANO_BLOCKS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def nemotron_blocks(pattern: str) -> list[str]:
    return [_NANO_BLOCKS[c] for c in pattern]


_NEMOTRON_NANO = dict(model_type="nemotron_h", hidden_size=2688, num_hidden_layers=52,
                      layers_block_type=nemotron_blocks(_NANO_PATTERN), num_attention_heads=32, num_key_value_heads=2,
                      head_dim=128, intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                      ssm_state_size=128, conv_kernel=4, n_routed_experts=128, num_experts_per_tok=6,
                      moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
                      n_group=1, topk_group=1, norm_topk_prob=True, vocab_size=131072, tie_word_embeddings=False)
SHAPES.update({
    "nemotron-nano": _NEMOTRON_NANO,
    "nemotron-nano-8l": {**_NEMOTRON_NANO, "num_hidden_layers": 8, "layers_block_type": nemotron_blocks("MEMEM*EM")},
    "tiny-nemotron": dict(model_type="nemotron_h", hidden_size=64, num_hidden_layers=4,
                          layers_block_type=nemotron_blocks("ME*E"), num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                          ssm_state_size=16, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, vocab_size=1000,
                          tie_word_embeddings=False),
})
# Qwen3.5 as it is released: every checkpoint on the hub is the vision-language `Qwen3_5ForConditionalGeneration`
# (the text shape's language model under `model.language_model.*`, a vision tower under `model.visual.*`). A
# `-vl` shape is its text shape written in that form (`write_model`), with transformers' default Qwen3.5 vision
# tower (27 blocks of 1152; its output projected to the text width): lathe runs text-only data on it through the
# language model alone, so its figures (FLOPs, roofline) are the text shape's.
VL_FORMS = {"qwen3.5-2b-vl": "qwen3.5-2b", "tiny-qwen3.5-vl": "tiny-qwen3.5"}
SHAPES.update({vl: SHAPES[text] for vl, text in VL_FORMS.items()})
DENSE_SHAPES = sorted(k for k, v in SHAPES.items() if "model_type" not in v)   # Qwen2.5: what Qwen2Config builds
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0)]   # dense datasheet
HBM_TBPS = [("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8), ("A100", 2.0)]   # datasheet TB/s


# -- where a result comes from ----------------------------------------------------------------------------------------
def git_sha() -> str:
    """HEAD's sha, or $LATHE_GIT_SHA where set (a copied working tree's .git may be stale)."""
    if os.environ.get("LATHE_GIT_SHA"):
        return os.environ["LATHE_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def default_workdir(name: str) -> str:
    """`<temp dir>/<name>`, a bench's default `--workdir`. The temp dir is `$TMPDIR`'s, which `bench/parallel.py` sets
    apart for each arm: two arms side by side once shared /tmp/lathe-e2e, and each read the other's metrics (a 7B A/B
    came back as two copies of one run)."""
    return str(Path(tempfile.gettempdir()) / name)


_WORKDIR_LOCKS: dict = {}            # resolved workdir -> its lock file, held open (so locked) for the bench's life


def claim_workdir(where: Path) -> Path:
    """Create `where` and lock it for this process's life; a second bench given the same workdir (run side by side)
    stops at once, naming it, rather than writing over the first one's model, data and metrics. The process holding
    it claims it again at no cost (e2e.py and sft.py claim it once per model of `--models`: a lock taken on a new
    descriptor would be refused by the process's own first one)."""
    where.mkdir(parents=True, exist_ok=True)
    if where.resolve() in _WORKDIR_LOCKS:
        return where
    lock = open(where / ".bench.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        sys.exit(f"{where} is in use by another bench running now (it holds {where / '.bench.lock'}): give this one "
                 "a --workdir of its own (bench/parallel.py gives each arm its own temp dir)")
    _WORKDIR_LOCKS[where.resolve()] = lock
    return where


def print_and_write(result: dict, out: str | None) -> None:
    """A benchmark's result printed as JSON, and written to `out` (its folder made) where given."""
    print(json.dumps(result, indent=1))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def graph_seconds(fn, *, captured: int = 1, reps: int = 20, warmup: int = 3) -> float:
    """Seconds a replay of one CUDA graph holding `captured` calls of `fn` takes (after `warmup` calls on a side
    stream and one replay), the mean over `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(captured):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- datasheet figures and rooflines ----------------------------------------------------------------------------------
def datasheet_peak(name: str) -> float | None:
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def hbm_bandwidth(name: str) -> float | None:
    return next((tb * 1e12 for key, tb in HBM_TBPS if key in name), None)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def roofline_tok_s(shape: dict, wbytes: int, prompt_lens: list[int], out_lens: list[int], bandwidth: float,
                   touched: bool = False) -> float:
    """Generated tokens over the minimum decode time: each step reads the weights (`wbytes`), every running
    sequence's KV once and its linear-attention states (a hybrid's, read and written back: `linear_state_bytes`);
    the sequences run together from the start, as they do in both loads. `touched`: a MoE shape's step also reads
    the experts beyond the active ones that its running rows are expected to touch (`roofline.touched_weight_bytes`
    over `decode_weight_bytes`); no change for a dense shape."""
    kvt, state = kv_bytes_per_token(shape), linear_state_bytes(shape)
    steps = max(out_lens)
    seconds = 0.0
    for t in range(steps):
        running = [p + t for p, o in zip(prompt_lens, out_lens) if t < o]
        extra = touched_weight_bytes(shape, len(running)) - decode_weight_bytes(shape) if touched else 0
        seconds += (wbytes + extra + sum(running) * kvt + len(running) * state) / bandwidth
    return sum(out_lens) / seconds


def train_flops(shape: dict, lengths: list[int]) -> float:
    """Model FLOPs of forward + backward (3x forward): linear layers incl. lm_head on every token (a MoE shape: its
    active experts and router), plus causal attention (`roofline.forward_flops`)."""
    return 3 * forward_flops(shape, lengths, sum(lengths))


# -- random-weight models and workloads -------------------------------------------------------------------------------
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM"}


def hf_config(shape_name: str, **overrides) -> dict:
    """The transformers config dict of a SHAPES entry (transformers' own defaults for what the entry does not set:
    a Qwen2.5 shape with rope_theta 1e6; a Qwen3.5 shape with the published rope; GPT-OSS's YaRN rope), with
    `architectures` set."""
    from transformers import AutoConfig
    shape = dict(SHAPES[shape_name])
    model_type = shape.pop("model_type", "qwen2")
    if model_type == "qwen2":
        shape.update(rope_theta=1e6, rms_norm_eps=1e-6)
    if model_type.startswith("qwen3_5"):
        shape["rope_parameters"] = dict(_QWEN35_ROPE)
    if "num_experts" in shape and model_type == "gpt_oss":
        shape["num_local_experts"] = shape.pop("num_experts")
    elif "num_experts" in shape:
        shape["num_local_experts"] = shape["num_experts"]      # transformers 5.24's name; 5.17 reads num_experts
    d = AutoConfig.for_model(model_type, **{**shape, **overrides}).to_dict()
    d["architectures"] = [ARCHITECTURES[model_type]]
    return d


def build_hf(shape_name: str, device, dtype):
    """A random-weight transformers model of a bench shape, in `dtype` (RoPE frequencies kept in float32). Built in
    float32 and cast, unless its float32 weights would take more than half the device's memory (Qwen3.5-35B-A3B's
    40 layers: 140 GB): then built in `dtype` directly (the same initialisation, rounded at each draw instead of
    once)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = hf_config(shape_name, max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa" if "sliding_window" not in SHAPES[shape_name] else "eager"
    device = torch.device(device)
    large = device.type == "cuda" and 4 * param_count(SHAPES[shape_name]) > torch.cuda.get_device_properties(
        device).total_memory / 2
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if large else {}))
    return cast_keeping_rope(model, dtype).train()


def random_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def fixed_load_engine(name: str, device, args):
    """(engine, prompts, params) of the fixed load for a random-weight bf16 model of shape `name`: `args.prompts`
    prompts of `args.prompt_len` tokens, `args.new_tokens` forced new tokens, the engine at
    `args.gpu_memory_utilization` (the transformers copy the weights come from is freed)."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.models.hf import lathe_from_transformers
    from lathe.generation import SamplingParams
    shape = SHAPES[name]
    hf = build_hf(name, device, torch.bfloat16).eval()
    model = lathe_from_transformers(hf).eval()
    del hf
    torch.cuda.empty_cache()
    prompts = random_prompts(args.prompts, args.prompt_len, args.prompt_len, shape["vocab_size"], 0)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine = LatheEngine(model, eos_token_id=shape["vocab_size"] - 1, max_num_seqs=args.prompts,
                         gpu_memory_utilization=args.gpu_memory_utilization, **batched_tokens(args))
    return engine, prompts, params


def batched_tokens(args) -> dict:
    """The engine's `max_num_batched_tokens` when the command line sets one (else the engine's default)."""
    n = getattr(args, "max_num_batched_tokens", None)
    return {} if n is None else {"max_num_batched_tokens": n}


# -- profiles ---------------------------------------------------------------------------------------------------------
def profile_summary(step, device, top: int = 12) -> dict:
    """Device time of one step by category (matmul, attention, other) and its top kernels."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    sync(device)
    with profile(activities=acts) as prof:
        step()
        sync(device)
    return summarize_profile(prof, device, top)


def summarize_profile(prof, device, top: int = 12) -> dict:
    """`profile_summary`'s figures from a finished torch.profiler run."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] \
        if device.type == "cuda" else list(prof.key_averages())

    def self_us(e):
        if device.type == "cuda":
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        return e.self_cpu_time_total
    total = sum(self_us(e) for e in events) or 1.0
    cats = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        name = e.key.lower()
        cat = ("attention" if re.search(r"flash|fmha|sdpa|attn|attention|_decode_kernel", name) else
               "matmul" if re.search(r"gemm|matmul|cutlass|xmma|nvjet|cublas|mm_", name) else "other")
        cats[cat] += self_us(e)
    rows = sorted(events, key=self_us, reverse=True)[:top]
    return {"device_ms": total / 1e3,
            "share": {k: v / total for k, v in cats.items()},
            "top": [{"name": e.key[:120], "ms": self_us(e) / 1e3, "share": self_us(e) / total, "calls": e.count}
                    for e in rows]}


# the driver's phases (its metrics' timing_s/...) and the worker-group methods that run them on the ranks
RANK_PHASES = {"gen": "actor_rollout_ref.generate_sequences", "old_log_prob": "actor_rollout_ref.compute_log_prob",
               "ref": "actor_rollout_ref.compute_ref_log_prob", "update_actor": "actor_rollout_ref.update_actor",
               "update_weights": "actor_rollout_ref.sync_weights"}


def driver_over_ranks(profile: dict) -> dict:
    """A profiled step of Ray workers (lathe's global_profiler summary): per phase, the driver's wall, the slowest
    rank's, and the driver's seconds above it (cutting and joining the batch, moving it, waiting for the last rank
    to start: 4 H200s once showed 0.15-0.24 s a phase there, from the driver's torch threads)."""
    ranks = profile.get("ranks") or {}
    out = {}
    for phase, method in RANK_PHASES.items():
        driver = (profile.get("phases") or {}).get(phase, {}).get("wall_s")
        walls = [r["phases"][method]["wall_s"] for r in ranks.values()
                 if (r.get("phases") or {}).get(method, {}).get("wall_s") is not None]
        if driver is not None and walls:
            out[phase] = {"driver_s": driver, "slowest_rank_s": max(walls), "over_s": driver - max(walls)}
    return out


# -- lathe as a user runs it: files on disk and a child process -------------------------------------------------------
REWARD_FILE = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Cheap and deterministic: the response's length in characters, folded into [0, 1)."""
    return (len(solution_str) % 97) / 97.0
'''


def write_model(shape: str, where: Path, device: str, *, name: str = "model", seed: int = 0,
                tokenizer: Path | None = None, edit=None) -> Path:
    """A random-weight checkpoint of `shape` (bf16 safetensors + config.json) in `where/<name>-<shape>`, written
    once; `tokenizer`: a `write_tokenizer` directory whose files are copied beside it (a distillation teacher loads
    its tokenizer from its own directory); `edit`: called on the initialised `LatheCausalLM` before it is saved
    (bench/fully_async.py plants its two-mode chain so), under no_grad. The directory is the cache key: a caller whose
    edit has parameters names them in `name`."""
    import shutil
    from lathe.models.config import LatheConfig
    from lathe.models.decoder import LatheCausalLM, init_weights
    out = where / f"{name}-{shape}"
    if (out / "config.json").exists():
        return out
    hf = hf_config(VL_FORMS.get(shape, shape), max_position_embeddings=4096, eos_token_id=0, pad_token_id=0,
                   bos_token_id=None)
    cfg = LatheConfig.from_hf_dict(hf, source=f"bench shape {shape}")
    torch.manual_seed(seed)     # (before the build: what init_weights leaves, a Qwen3.5 conv1d, is drawn there)
    with torch.device(device):
        model = LatheCausalLM(cfg).to(torch.bfloat16)
    init_weights(model)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(out)
    del model
    if shape in VL_FORMS:
        as_vl_checkpoint(out, hf, device)
    for f in (tokenizer.iterdir() if tokenizer else ()):
        shutil.copy(f, out / f.name)
    if torch.cuda.is_available():      # the trainers run in child processes: this one must not keep the GPU's memory
        torch.cuda.empty_cache()
    return out


def as_vl_checkpoint(out: Path, text: dict, device: str) -> None:
    """Rewrite the Qwen3.5 text checkpoint in `out` (transformers config dict `text`) as the released
    `Qwen3_5ForConditionalGeneration`: the language model's tensors under `model.language_model.*` (`lm_head`
    as it was), a random bf16 vision tower (transformers' default Qwen3.5 vision config, projecting to the text
    width) under `model.visual.*`, and the whole model's config.json (transformers' token ids, the text
    config's tie flag at the top, where it decides)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    text = {k: v for k, v in text.items() if k != "architectures"}
    rope = dict(text["rope_parameters"])
    if text["head_dim"] * rope.get("partial_rotary_factor", 1.0) < 16:   # a CPU smoke shape: room for 3 sections
        rope["partial_rotary_factor"] = 1.0
    half = int(text["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
    hw = round(half * 11 / 32)                  # the released [11, 11, 10] over 32 rotary pairs
    text["rope_parameters"] = {**rope, "mrope_section": [hw, hw, half - 2 * hw], "mrope_interleaved": True}
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(out_hidden_size=text["hidden_size"]),
                        tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(1)
    with torch.device(device):
        tower = Qwen3_5VisionModel._from_config(cfg.vision_config).to(torch.bfloat16)
    state = {}
    for f in sorted(out.glob("model*.safetensors")):
        state.update({("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                      for k, v in load_file(f).items()})
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    state.update({"model.visual." + k: v.detach().cpu().contiguous() for k, v in tower.state_dict().items()})
    del tower
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    d.update(architectures=["Qwen3_5ForConditionalGeneration"], dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(d, indent=2))


def write_tokenizer(vocab_size: int, where: Path) -> Path:
    """A word-level tokenizer: id 0 `<eos>` (also pad), id 1 `<unk>`, then synthetic words `w2 .. w{V-1}`. Kept in a
    directory of its own (transformers 5 would read a tokenizer beside a qwen2 config.json as Qwen2Tokenizer).
    (Special tokens must not look like words: added tokens match inside words, `w1` would split `w136`.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    out = where / f"tokenizer-{vocab_size}"
    if (out / "tokenizer.json").exists():
        return out
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(out)
    return out


def write_data(where: Path, *, rows: int, prompt_len: int, vocab_size: int,
               last_word: int | None = None) -> tuple[Path, Path]:
    """verl-schema parquet (chat prompts, for lathe) and JSON lines of the same prompts as text (for TRL).
    `last_word`: every prompt's last token is this id instead (the same random draws before it; bench/fully_async.py's
    two-mode workload picks each response's mode through it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(2, vocab_size, (prompt_len,), generator=g))
             for _ in range(rows)]
    if last_word is not None:
        texts = [t.rsplit(" ", 1)[0] + f" w{last_word}" if prompt_len > 1 else f"w{last_word}" for t in texts]
    parquet, jsonl = where / f"train-{prompt_len}.parquet", where / f"train-{prompt_len}.jsonl"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "e2e", "prompt": [{"role": "user", "content": t}], "ability": "bench",
         "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}}
        for i, t in enumerate(texts)]), parquet)
    jsonl.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return parquet, jsonl


class _Terminated(Exception):
    """The bench got SIGTERM (an outer `timeout`) while a child ran."""


_TERMINATED = False          # set once: later `run_child` calls return at once


def _on_term(signum, frame):
    raise _Terminated


def _note_term(signum, frame):
    """A SIGTERM while a timed-out child stops: noted (later calls start nothing), the stop goes on."""
    global _TERMINATED
    _TERMINATED = True


STOP_GRACE_S = 15.0      # how long a SIGTERMed child may take to close its Ray workers and process groups


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the child (its Ray workers and process groups close), SIGKILL after `STOP_GRACE_S`."""
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_child(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run one `lathe train` (or baseline) child, its output into `log`: (return code, seconds); 124 past `timeout`.

    A SIGTERM to the bench while the child runs (a GPU call's outer `timeout`) stops the child and returns 143, so
    the caller still writes the JSON of what the child's metrics.jsonl holds (a 7B A/B was lost once to a kill that
    came as its child exited); later calls then return 143 at once without starting anything, and further SIGTERMs
    are ignored (a second one while the child stopped lost a data-parallel-attention run's JSON). A SIGTERM while a
    child past its own `timeout` stops is noted the same way and the stop goes on (124)."""
    global _TERMINATED
    if _TERMINATED:
        return 143, 0.0
    start = time.perf_counter()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_term) if main else None
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
                                         **(env or {})})
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if main:        # an outer SIGTERM during the stop lost a Qwen3.5 run's JSON (2026-12-02)
                    signal.signal(signal.SIGTERM, _note_term)
                _stop(proc)
                rc = 124
            except _Terminated:
                _TERMINATED = True
                signal.signal(signal.SIGTERM, signal.SIG_IGN)   # (a second one while the child stops: the JSON
                _stop(proc)                                      # was lost so once, 2026-11-30)
                rc = 143
    finally:
        if main:        # (after a SIGTERM the bench ignores more of them: it writes what it has, then exits)
            signal.signal(signal.SIGTERM, signal.SIG_IGN if _TERMINATED else previous)
    return rc, time.perf_counter() - start


def lathe_row(steps: list[dict], warmup: int, flops: float, peak_tflops: float | None, profiled: int = 0,
              matmul_rate: float | None = None) -> dict:
    """`peak_tflops`: of all the GPUs the run uses (MFU is per GPU); `matmul_rate`: their measured bf16 matmul
    FLOP/s (`roofline.device_rates`), for the update's MFU against it (issue 48's figure) beside the datasheet's.
    `profiled`: a step (1-based) left out of the median, since the profiler slowed it."""
    timed = [s for i, s in enumerate(steps) if i >= warmup and i + 1 != profiled] or steps[-1:]
    med = lambda key: statistics.median(s[key] for s in timed) if all(key in s for s in timed) else None  # noqa: E731
    phases = sorted({k for s in timed for k in s if k.startswith("timing_s/")})
    row = {"step_s": med("timing_s/step"), "phases_s": {k.split("/", 1)[1]: med(k) for k in phases},
           "tokens_per_s": med("perf/throughput"), "steps_timed": len(timed),
           "step_s_all": [s.get("timing_s/step") for s in steps],
           "gc_s_all": [s.get("timing_s/gc") for s in steps],       # the collector's pauses, step by step
           "gc_full_passes_all": [s.get("perf/gc_full_passes") for s in steps],
           "max_memory_allocated_gb": max((s.get("perf/max_memory_allocated_gb", 0) for s in steps), default=None),
           "max_memory_reserved_gb": max((s.get("perf/max_memory_reserved_gb", 0) for s in steps), default=None),
           "max_memory_allocated_gb_by_phase": {k.rsplit("/", 1)[1]: max(s.get(k, 0) for s in steps)
                                                 for k in steps[-1] if k.startswith("perf/max_memory_allocated_gb/")}}
    row["rollout"] = {k.split("/", 1)[1]: med(k) for k in sorted({k for s in timed for k in s
                                                                   if k.startswith("rollout/")})}
    # the devices' energy and mean power per phase (lathe.track.energy: NVML's counters)
    for key, name in (("perf/energy_j/", "energy_j_by_phase"), ("perf/power_w/", "power_w_by_phase")):
        found = sorted({k for s in timed for k in s if k.startswith(key)})
        if found:
            row[name] = {k[len(key):]: med(k) for k in found}
    if med("perf/power_limit_w") is not None:
        row["power_limit_w"] = med("perf/power_limit_w")
    # the rollout/trainer log-prob gap and rollout correction's statistics (FP8 rollout or training: issue 48)
    row["consistency"] = {k: med(k) for k in sorted({k for s in timed for k in s
                                                     if k.startswith(("training/rollout_probs_diff", "rollout_corr/"))})}
    # the KL loss step by step (a quantised reference: step 1's, where actor = reference, is the quantisation's gap)
    if any("actor/kl_loss" in s for s in steps):
        row["consistency"]["kl_loss_all"] = [s.get("actor/kl_loss") for s in steps]
    wake, gb = row["phases_s"].get("rollout_wake_up"), row["rollout"].get("kv_cache_gb")
    if wake is not None and gb:
        row["rollout"]["wake_up_ms_per_gb"] = 1000 * wake / gb
    update = row["phases_s"].get("update_actor")
    if update and peak_tflops:
        row["update_mfu"] = flops / update / 1e12 / peak_tflops
    if update and matmul_rate:
        row["update_mfu_measured_rate"] = flops / update / matmul_rate
    return row
