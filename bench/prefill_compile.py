"""Host cost of a prefill forward by how the decoder is compiled: per layer (lathe's engine today) or the whole
model as one graph with attention an opaque custom op (the cut vLLM V1 makes).

    python bench/prefill_compile.py [--device cpu|cuda] [--model tiny|0.5b] [--tokens 64,8192] [--repeats 30]
                                    [--out bench/results/prefill_compile_<device>.json]

Today each decoder layer is compiled on its own and breaks its graph at attention (`decoder._attend`, eager, since
the attention objects carry per-batch Python state), so an 8192-token 0.5B prefill step enters ~48 compiled regions
and 24 eager calls; `bench/step_probe.py` found that step host-bound on an H100. The alternative here: one
`torch.compile` over embedding, every layer and the final norm, the attention of layer i a custom op
`lathe_bench::attend(q, k, v, i)` that reads the step's attention object from a module global (set before the
forward), so dynamo sees one opaque call per layer and no graph break.

A third variant compiles the whole model with inductor's `cpp_wrapper` (the graph's kernel launches issued from C++).
All run the same modules on the same inputs with a stand-in attention (causal SDPA over the step's tokens, one
sequence), compiled with inductor, token dimension dynamic. Reported per token count: the median wall time of a
forward, the host time to issue it (CUDA: until the call returns, before the device finishes), and the outputs'
norm-relative difference. On the CPU the forward's compute is the host's too: use few tokens there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

from lathe.models.compile import compile_decoder  # noqa: E402
from lathe.models.config import LatheConfig  # noqa: E402
from lathe.models.decoder import LatheCausalLM  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64),
}

_STEP = {"attn": None}          # the step's attention callable, read by the custom op


@torch.library.custom_op("lathe_bench::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _STEP["attn"](q, k, v)


@attend.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(T, Hq, D), (T, Hkv, D) -> (T, Hq, D): one causal sequence (stands in for the engine's varlen attention)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def whole_model_forward(model, options: dict | None = None):
    """One compiled function over the decoder: every layer's steps spelled out, attention through the custom op.
    `options`: inductor options (`cpp_wrapper`: the graph's host code in C++ instead of Python)."""
    decoder = model.model

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(decoder.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            x = x + layer.self_attn.o_proj(attend(q, k, v, i).flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return decoder.norm(x)

    return torch.compile(forward, dynamic=True, options=options)


def timed(fn, device, repeats: int) -> dict:
    walls, issues = [], []
    for _ in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        issued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        issues.append((issued - start) * 1e3)
    return {"wall_ms": statistics.median(walls[3:]), "issue_ms": statistics.median(issues[3:]), "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = LatheConfig(architecture="Qwen2ForCausalLM", max_position_embeddings=32768, qkv_bias=True,
                      **SHAPES[args.model])
    model = LatheCausalLM(cfg).to(device=device, dtype=dtype).eval()
    whole = whole_model_forward(model)
    whole_cpp = whole_model_forward(model, {"cpp_wrapper": True})
    per_layer = compile_decoder(LatheCausalLM(cfg).to(device=device, dtype=dtype).eval())
    per_layer.load_state_dict(model.state_dict())
    _STEP["attn"] = causal_attention
    res = {**result_header("prefill_compile", device, args), "model": args.model, "tokens": {}}
    with torch.inference_mode():
        for n in map(int, args.tokens.split(",")):
            ids = torch.randint(0, cfg.vocab_size, (n,), device=device)
            pos = torch.arange(n, device=device)
            for m in (n + 8, n):                      # a second length first: both compile for dynamic tokens
                whole(ids[:1].repeat(m), torch.arange(m, device=device))
                whole_cpp(ids[:1].repeat(m), torch.arange(m, device=device))
                per_layer.model(ids[:1].repeat(m), torch.arange(m, device=device), causal_attention)
            a = timed(lambda: per_layer.model(ids, pos, causal_attention), device, args.repeats)
            b = timed(lambda: whole(ids, pos), device, args.repeats)
            c = timed(lambda: whole_cpp(ids, pos), device, args.repeats)
            ref = a.pop("out").float()
            diff = {k: float((r.pop("out").float() - ref).norm() / ref.norm()) for k, r in (("whole_model", b),
                                                                                             ("cpp_wrapper", c))}
            row = {"per_layer": a, "whole_model": b, "whole_model_cpp_wrapper": c, "rel_diff": diff}
            res["tokens"][str(n)] = row
            print(f"{args.model} {n} tokens: per-layer {a['wall_ms']:.2f} ms (issue {a['issue_ms']:.2f}), whole model "
                  f"{b['wall_ms']:.2f} ms (issue {b['issue_ms']:.2f}), with cpp_wrapper {c['wall_ms']:.2f} ms (issue "
                  f"{c['issue_ms']:.2f}), rel diff {diff}", flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
