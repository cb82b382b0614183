"""GPT-OSS's actor/kl_loss at step 1: the reference's response log-probs against the actor's, per factor (eager or
compiled, train or eval mode, grad or not, micro-batch, attention backend), each against a float32 forward with the
explicit attention; K3 KL, mean and max |difference| per pair. A random-weight checkpoint of `shape` (bench SHAPES,
or tiny-oss for a CPU check), 16 rows of 256 + 256 random tokens on CUDA.

    python bench/moe_kl_probe.py gpt-oss-20b-4l cuda OUT.json

Found (kl_probe_gpt-oss-20b-4l_nvidia-h200.json): every bf16 forward is K3 ~0.06 from the float32 one and compiled
against eager ~0.05 (routing near-ties of random weights amplify rounding); the reference and the actor agree bit
for bit when they run the same kernels."""
import json
import sys
import time
from pathlib import Path

import torch
sys.path.insert(0, "bench"); sys.path.insert(0, "src")
import common  # noqa: E402
shape, device, out = sys.argv[1], torch.device(sys.argv[2]), sys.argv[3]
common.SHAPES["tiny-oss"] = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_experts=8,
    num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=1024, tie_word_embeddings=False, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2)
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.models.hf import load_policy
from lathe.models.frozen import frozen_copy
from lathe.models.rope import cast_keeping_rope
from lathe.models.compile import maybe_compile
from lathe.train.logprob import batched_log_probs, batched_token_stats

t0 = time.time()
path = common.write_model(shape, Path("/tmp/klprobe"), str(device))
V = common.SHAPES[shape]["vocab_size"]
P, R, rows = (256, 256, 16) if device.type == "cuda" else (24, 12, 4)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, V, (P,), generator=g).tolist() for _ in range(rows)]
resps = [torch.randint(2, V, (R,), generator=g).tolist() for _ in range(rows)]
batch = to_batch(prompts, RolloutOutput(resps, [[0.0] * R for _ in resps], ["length"] * rows), 0, n=1)
mask = batch["response_mask"].bool()
bf = torch.bfloat16 if device.type == "cuda" else torch.float32

def lp(model, grad=False, micro=16, stats=False):
    with torch.enable_grad() if grad else torch.no_grad():
        if stats or grad:
            x = batched_token_stats(model, batch.to(device), micro_batch_size=micro, temperature=1.0,
                                       calculate_entropy=True, remove_padding=True)[0]
        else:
            x = batched_log_probs(model, batch.to(device), micro_batch_size=micro, temperature=1.0,
                                  remove_padding=True)[0]
    return x.detach().double().cpu()

res = {"shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": common.git_sha(), "pairs": {}}
base = load_policy(str(path))                      # float32 on the CPU, as the trainer loads it
truth32 = frozen_copy(base, torch.float32, device); truth32.attn_backend = "sdpa"
vals = {"fp32_sdpa": lp(truth32)}
del truth32
actor = cast_keeping_rope(base, bf, device).train()          # model_dtype=bf16: the actor's own weights in bf16
ref = frozen_copy(actor, bf, device)
vals["ref_eager"] = lp(ref)
vals["ref_eager_micro8"] = lp(ref, micro=8)
vals["actor_eager_train_nograd"] = lp(actor)
vals["actor_eager_train_grad"] = lp(actor, grad=True, micro=8)
actor.eval(); vals["actor_eager_eval_nograd"] = lp(actor); actor.train()
ref_sdpa = frozen_copy(actor, bf, device); ref_sdpa.attn_backend = "sdpa"
vals["ref_eager_sdpa"] = lp(ref_sdpa); del ref_sdpa
maybe_compile(ref, True, device=device); maybe_compile(actor, True, device=device)
vals["ref_compiled"] = lp(ref)
vals["actor_compiled_train_nograd"] = lp(actor, stats=True)
vals["actor_compiled_train_grad"] = lp(actor, grad=True, micro=8)

def k3(a, b):
    d = (a - b)[mask]
    return {"k3": float((torch.exp(d) - d - 1).mean()), "mean_abs": float(d.abs().mean()),
            "max_abs": float(d.abs().max())}
names = list(vals)
for n in names:
    res["pairs"][f"{n} vs fp32_sdpa"] = k3(vals[n], vals["fp32_sdpa"])
for a, b in [("ref_eager", "actor_eager_train_grad"), ("ref_compiled", "actor_compiled_train_grad"),
             ("ref_compiled", "actor_compiled_train_nograd"), ("ref_eager", "ref_compiled"),
             ("actor_eager_train_grad", "actor_compiled_train_grad"), ("ref_eager", "ref_eager_sdpa"),
             ("actor_eager_train_nograd", "actor_eager_eval_nograd"), ("ref_eager", "actor_eager_train_nograd")]:
    res["pairs"][f"{a} vs {b}"] = k3(vals[a], vals[b])
res["wall_s"] = time.time() - t0
for k, v in res["pairs"].items():
    print(f"{k:60s} k3 {v['k3']:.3g}  mean|d| {v['mean_abs']:.3g}  max|d| {v['max_abs']:.3g}")
json.dump(res, open(out, "w"), indent=1)
