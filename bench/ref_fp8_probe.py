"""Probe: the reference's log-prob pass (batched_log_probs, packed, compiled) in bf16 against the same model with
the engine's FP8 projections (quantize_model: per-channel weights, per-token activations), e2e's 1.5B shape."""
import copy, json, os, sys, time
import torch
sys.path.insert(0, 'bench'); sys.path.insert(0, 'src')
from common import build_hf, SHAPES
from lathe.models.hf import lathe_from_transformers
from lathe.models.compile import maybe_compile
from lathe.engine.fp8 import quantize_model
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train.logprob import batched_log_probs

dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
name = sys.argv[1] if len(sys.argv) > 1 else '1.5b'
model = lathe_from_transformers(build_hf(name, dev, torch.bfloat16).eval(), clone=True).eval()
vocab = SHAPES[name]['vocab_size']
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, vocab, (int(os.environ.get('PL', 256)),), generator=g).tolist() for _ in range(256)]
responses = [torch.randint(2, vocab, (int(os.environ.get('RL', 512)),), generator=g).tolist() for _ in range(256)]
batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses] if True else [[0.0] for _ in responses], ["length"] * 256), 0, n=1)
fp8 = copy.deepcopy(model)
quantize_model(fp8)
res = {}
for label, m in (("bf16", model), ("fp8", fp8)):
    maybe_compile(m, True, device=dev)
    for _ in range(2):
        lp, _ = batched_log_probs(m, batch.to(dev), micro_batch_size=32, remove_padding=True)
    sync()
    times = []
    for _ in range(4):
        t = time.perf_counter()
        lp, _ = batched_log_probs(m, batch.to(dev), micro_batch_size=32, remove_padding=True)
        sync()
        times.append(time.perf_counter() - t)
    res[label] = {"s": sorted(times)[1:3], "lp": lp}
    print(label, times, flush=True)
d = (res["bf16"]["lp"] - res["fp8"]["lp"]).float()
out = {"what": "ref pass bf16 vs engine FP8 projections", "model": name, "device": str(dev),
       "bf16_s": res["bf16"]["s"], "fp8_s": res["fp8"]["s"], "abs_diff_mean": d.abs().mean().item(),
       "abs_diff_max": d.abs().max().item(), "kl_proxy_mean": (d.exp() - 1 - d).mean().item()}
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"ref_fp8_probe_{name}.json"), "w"), indent=1)
