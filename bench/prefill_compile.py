"""Host cost of a prefill forward by how the decoder is compiled: per layer (lathe's engine today) or the whole
model as one graph with attention an opaque custom op (the cut vLLM V1 makes).

    python bench/prefill_compile.py [--device cpu|cuda] [--model tiny|0.5b] [--tokens 64,8192] [--repeats 30] [--rounds 1]
                                    [--variants per_layer,per_layer_op,whole_model,whole_model_cpp_wrapper]
                                    [--out bench/results/prefill_compile_<device>.json]

Today each decoder layer is compiled on its own and breaks its graph at attention (`decoder._attend`, eager, since
the attention objects carry per-batch Python state), so an 8192-token 0.5B prefill step enters ~48 compiled regions
and 24 eager calls; `bench/step_probe.py` found that step host-bound on an H100. The alternative here: one
`torch.compile` over embedding, every layer and the final norm, the attention of layer i a custom op
`lathe_bench::attend(q, k, v, i)` that reads the step's attention object from a module global (set before the
forward), so dynamo sees one opaque call per layer and no graph break.

A third variant compiles the whole model with inductor's `cpp_wrapper` (the graph's kernel launches issued from C++).
All run the same modules on the same inputs with a stand-in attention (causal SDPA within each 256-token prompt
of the step), compiled with inductor, token dimension dynamic. Reported per token count: the median wall time of a
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
from lathe.models.decoder import LatheCausalLM, _mark_token_dims_dynamic  # noqa: E402

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


SEQ_LEN = 256                   # the stand-in attention's sequences: a step of T tokens is T / 256 prompts


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, S, Hq, D), (B, S, Hkv, D) -> (B, S, Hq, D): causal attention within each of B sequences."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(T, Hq, D), (T, Hkv, D) -> (T, Hq, D): the step's tokens as prompts of SEQ_LEN tokens (the last one shorter),
    each attending causally to itself: the work of the engine's varlen prefill of a fixed load's prompts."""
    t = q.shape[0]
    full = t - t % SEQ_LEN
    parts = []
    if full:
        parts.append(_causal(*(x[:full].unflatten(0, (full // SEQ_LEN, SEQ_LEN)) for x in (q, k, v))).flatten(0, 1))
    if full < t:
        parts.append(_causal(q[None, full:], k[None, full:], v[None, full:])[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


@torch.library.custom_op("lathe_bench::attend_step", mutates_args=())
def attend_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _STEP["attn"](q, k, v)


@attend_step.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class OpLayer(torch.nn.Module):
    """A decoder layer whose attention is the custom op `lathe_bench::attend_step` (no layer argument: the real
    engine would pass the layer's KV cache tensors instead), so a compiled layer is one graph, no break. Every
    wrapper shares this forward's code object and so one compiled graph, as the engine's `DecoderLayer` does."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
        x = x + layer.self_attn.o_proj(attend_step(q, k, v).flatten(-2))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def per_layer_op_forward(model):
    """Each layer one compiled graph with attention inside it as a custom op; embedding and final norm eager."""
    decoder = model.model
    layers = [OpLayer(layer) for layer in decoder.layers]
    for layer in layers:
        layer.compile()                 # token dims marked dynamic below, feature dims static (as the engine's)

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(positions, x.dtype)
        _mark_token_dims_dynamic(x, cos, sin)
        for layer in layers:
            x = layer(x, cos, sin)
        return decoder.norm(x)

    return forward


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
    ap.add_argument("--variants", default="per_layer,per_layer_op,whole_model,whole_model_cpp_wrapper",
                    help="which of per_layer, per_layer_op, whole_model, whole_model_cpp_wrapper to run (the whole "
                         "model compiles in ~70 s on an H100 host, with cpp_wrapper ~160 s)")
    ap.add_argument("--rounds", type=int, default=1, help="times each variant is timed, variants interleaved")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = LatheConfig(architecture="Qwen2ForCausalLM", max_position_embeddings=32768, qkv_bias=True,
                      **SHAPES[args.model])
    model = LatheCausalLM(cfg).to(device=device, dtype=dtype).eval()
    variants = args.variants.split(",")
    per_layer = compile_decoder(LatheCausalLM(cfg).to(device=device, dtype=dtype).eval())
    per_layer.load_state_dict(model.state_dict())
    fns = {"per_layer": lambda ids, pos: per_layer.model(ids, pos, causal_attention),
           "per_layer_op": per_layer_op_forward(model),
           "whole_model": whole_model_forward(model),
           "whole_model_cpp_wrapper": whole_model_forward(model, {"cpp_wrapper": True})}
    unknown = set(variants) - set(fns)
    if unknown or "per_layer" not in variants:
        ap.error(f"--variants: {sorted(unknown)} unknown; per_layer (the reference) must be among {sorted(fns)}")
    _STEP["attn"] = causal_attention
    res = {**result_header("prefill_compile", device, args), "model": args.model, "tokens": {}, "compile_s": {}}
    with torch.inference_mode():
        for n in map(int, args.tokens.split(",")):
            ids = torch.randint(0, cfg.vocab_size, (n,), device=device)
            pos = torch.arange(n, device=device)
            row, outs = {}, {}
            for name in variants:
                start = time.perf_counter()
                for m in (n + 8, n):                  # a second length first: each compiles for dynamic tokens
                    fns[name](ids[:1].repeat(m), torch.arange(m, device=device))
                res["compile_s"].setdefault(name, round(time.perf_counter() - start, 2))
            for r in range(args.rounds):              # variants interleaved: the host's speed drifts over minutes
                for name in variants:
                    t = timed(lambda: fns[name](ids, pos), device, args.repeats)
                    outs[name] = t.pop("out")
                    for key, value in t.items():
                        row.setdefault(name, {}).setdefault(key + "_rounds", []).append(round(value, 3))
                    print(f"{args.model} {n} tokens round {r} {name}: {t['wall_ms']:.2f} ms (issue "
                          f"{t['issue_ms']:.2f})", flush=True)
            for name in variants:
                for key in ("wall_ms", "issue_ms"):
                    row[name][key] = statistics.median(row[name][key + "_rounds"])
            ref = outs["per_layer"].float()
            row["rel_diff"] = {k: float((o.float() - ref).norm() / ref.norm()) for k, o in outs.items()
                               if k != "per_layer"}
            print(f"rel diff {row['rel_diff']}", flush=True)
            res["tokens"][str(n)] = row
            write_result(res, args.out)               # each token count as it completes
    write_result(res, args.out)


if __name__ == "__main__":
    main()
