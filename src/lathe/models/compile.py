"""Opt-in torch.compile of lathe's decoder for training (verl's `use_torch_compile`).

Most of an eager training step outside the matmuls and attention is small elementwise kernels:
RMSNorm's float32 casts, RoPE, SwiGLU, residual adds, and the softmax/entropy math of the chunked
log-probs. Compiling fuses them. What is compiled:

- each decoder layer of ONE model instance (`layer.compile(...)`): norms, q/k/v/o projections, RoPE, MLP,
  residuals. The attention call itself stays eager (`decoder.attend` is `torch.compiler.disable`d), so
  varlen flash attention on CUDA and per-sequence SDPA on CPU run unchanged, and a layer compiles into a
  few graphs (before and after attention) shared by all layers of the model;
- the hybrid families' layers (Qwen3.5, Qwen3-Next: `lathe.models.qwen3_5`) the same way: their norms (zero-centred,
  gated), gates, projections, RoPE, MLP and residuals compile; what touches the linear-attention states stays eager
  like attention (`lathe.models.linear_attention`'s convolution and delta-rule functions, fla's kernels among them,
  and the engine's `LinearStep`, whose layer counter must run on every call: all `torch.compiler.disable`d);
- the per-chunk math of `lathe.models.logprob.chunked_log_probs` (logits -> log-prob, entropy, and the
  recomputing backward's gradient), when the caller passes the model's `compile_backend`.
The rollout engine compiles its own forms of the layers with the same backend (`lathe.engine.decode_forms`).

Shapes: packed streams change length every micro-batch, so the token dimensions are marked dynamic
(`decoder.mark_token_dims_dynamic`, and the chunk rows in `logprob`): one compile serves every length.
What still compiles again, a bounded number of times per code object (well under dynamo's recompile
limit of 8): grad mode (training vs the no-grad log-prob pass), and a token dimension of size 1 (0/1
specialisation). Gradient checkpointing recomputes through the same compiled graphs.

Variants: every compiled layer of every model in the process shares one code object (`DecoderLayer.forward`) and so
one list of compiled variants, which dynamo caps at `recompile_limit` (8 by default) before it runs further variants
eagerly, silently slower. A LoRA run with its engine on one device fills 8: the engine's prefill and decode attention
types, a decode batch of one, the trainer's grad and no-grad passes, and LoRA's module types for both
(`tests/models/test_compile.py`); FSDP2's wrapped layers or a critic add more. `compile_decoder` raises the cap to
`RECOMPILE_LIMIT`.

Compilation is per instance: another `LatheCausalLM` (the rollout engine's copy, the reference policy
built before) keeps running eager. CUDA only by default: on CPU, inductor's start-up (C++ builds, tens
of seconds) costs more than it saves for the models a CPU trains; `compile_decoder` itself runs anywhere.
"""

from __future__ import annotations

import torch

COMPILE_DEVICE_TYPES = ("cuda",)   # devices on which use_torch_compile=true compiles; elsewhere it runs eager
DEFAULT_BACKEND = "inductor"
RECOMPILE_LIMIT = 32               # compiled variants of the decoder layer's code allowed (see the module docstring)


def allow_variants(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep at least `limit` compiled variants per code object (never lowers a higher setting)."""
    cfg = torch._dynamo.config
    if cfg.recompile_limit < limit:
        cfg.recompile_limit = limit


def compile_decoder(model, *, backend: str = DEFAULT_BACKEND, mode: str | None = None):
    """Compile every decoder layer of `model` (a `LatheCausalLM` or `LatheValueModel`) in place; returns it.

    Also records `backend` as `model.compile_backend`, which the trainer's log-prob functions read to compile
    their chunk math with the same backend. Calling it twice is a no-op. Nothing is traced until the first
    forward, so the cost is paid on the first training step (tens of seconds on a GPU for a 28-layer model).
    """
    from lathe.models.decoder import LatheDecoderModel
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, LatheDecoderModel):
        raise TypeError(f"compile_decoder needs lathe's decoder (LatheCausalLM or LatheValueModel), got "
                        f"{type(model).__name__}; transformers models are not compiled by lathe")
    if decoder.compile_backend is not None:
        return model
    allow_variants()
    for layer in decoder.layers:
        layer.compile(backend=backend, mode=mode)   # dynamic=None: token dims are marked dynamic by the decoder
    decoder.compile_backend, decoder.compile_mode = backend, mode
    return model


def is_compiled(model) -> bool:
    """True when `compile_decoder` compiled this instance's layers."""
    return getattr(model, "compile_backend", None) is not None


def compile_enabled(use_torch_compile: bool, device: torch.device | str) -> bool:
    """verl's `use_torch_compile` resolved for a device: on when asked and the device type is in
    `COMPILE_DEVICE_TYPES` (CUDA), off elsewhere."""
    return bool(use_torch_compile) and torch.device(device).type in COMPILE_DEVICE_TYPES


def maybe_compile(model, use_torch_compile: bool, *, device: torch.device | str | None = None) -> bool:
    """Compile `model` when `use_torch_compile` is on, it is lathe's decoder, and it sits on a compiling device
    (`device`, default the model's own); returns whether it is compiled now. transformers models stay as given."""
    from lathe.models.decoder import LatheDecoderModel
    if not isinstance(getattr(model, "model", None), LatheDecoderModel):
        return False
    if compile_enabled(use_torch_compile, device if device is not None else model.device):
        compile_decoder(model, backend=DEFAULT_BACKEND)
    return is_compiled(model)
