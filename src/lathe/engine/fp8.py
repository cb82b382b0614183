"""FP8 rollout: the engine's decoder projections in float8 (`actor_rollout_ref.rollout.quantization=fp8`).

A decode step of a policy at a few hundred sequences reads every weight once; in bf16 the projections' weights are
most of those bytes. Here each projection of the decoder layers (q/k/v/o, gate/up/down, fused or not) also keeps an
FP8 copy, and the engine's forms multiply with it:

    w8[n, :] = w[n, :] / s_w[n],      s_w[n] = max_k |w[n, k]| / 448       (per output channel, E4M3)
    x8[t, :] = x[t, :] / s_x[t],      s_x[t] = max_k |x[t, k]| / 448       (per token, at run time)
    y[t, n]  = s_x[t] * s_w[n] * sum_k x8[t, k] w8[n, k]  (+ bias[n])

The vLLM/SGLang "fp8" scheme (dynamic per-token activations, per-channel weights). On a GPU the sum runs as
`torch._scaled_mm` with unit scales and fast accumulation (as vLLM's and torchao's FP8 GEMMs accumulate), and the
scales' outer product multiplies its bf16 result after (inductor folds that into the next kernel of a compiled layer):
cuBLAS's tensor-wise FP8 kernel is faster at decode rows than its row-wise one (`ROWWISE_GEMM`; measured in
`bench/results/fp8_gemm_7b_nvidia-h200.json`). What stays in the model's dtype:
embeddings, norms, the lm_head (the sampler's logits; `quantize_lm_head` puts it in FP8 too, as an option),
attention and its KV cache, a mixture of experts' layers and LoRA layers (their own forward runs), and a projection
whose features are not a multiple of 16 (the FP8 GEMM's alignment).

Each layer's q/k/v and gate/up get one FP8 copy (and one GEMM) a group even where the engine keeps their bf16
weights separate (`decode_forms.fuse_fp8_copies`, the engine's default: at 7B 1.38x bf16's tokens/s against 1.34x with
a copy per projection, `bench/results/rollout_fp8_copies_{fused,separate}_7b_nvidia-h200.json`).

With `FUSED_SWIGLU` (off by default) an FP8 MLP (`mlp_down`) quantises x once, multiplies gate and up with unit
scales, and dequantises them, takes SiLU(gate) * up and quantises it per token in one Triton kernel
(`swiglu_quantize`): one pass a row held in registers (up to 32768 wide), or two launches over spans of wider rows.
Alone it beats the same torch form compiled (0.60 ms at `ROW_WARPS` = 16, 0.54 at 32, against 0.82 for 28 layers
at 7B's width and 256 rows, `bench/results/fp8_swiglu_7b_nvidia-h200.json`), but inside the engine's compiled layer
inductor fuses that work into one kernel of about the same time (0.53 ms): the engine measured 1.37x with it against
1.38x without (`rollout_fp8_copies_fused_triton_7b_nvidia-h200.json`), so it stays off.

The bf16 weights stay where they are (the trainer's own tensors on one device, or the engine's copy that weight syncs
write): the FP8 copies are extra memory of half their size, made when the engine is built and re-quantised in place
after every weight update (`requantize`), so captured CUDA graphs keep reading the same addresses. The rollout's
log-probs then come from the FP8 model: they differ from the trainer's, which the trainer reports
(`training/rollout_probs_diff_*`) and corrects (rollout correction, on by default with FP8: `lathe.config.rules`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lathe.device import nvidia_capability
from lathe.models.decoder import MLP, Attention

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: `swiglu_quantize` runs in torch
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite E4M3 value
ALIGN = 16                 # `_scaled_mm` wants both matrix dimensions a multiple of 16
SCHEMES = ("fp8",)
ROWWISE_GEMM = False       # True: the scales inside the GEMM (`_scaled_mm`'s row-wise form); the A/B's other arm
FAST_ACCUM = True          # `_scaled_mm(use_fast_accum=...)`: Hopper's FP8 accumulation without periodic promotion
FUSED_SWIGLU = False       # an MLP's SwiGLU and the FP8 down projection's quantisation in Triton (CUDA; module doc)
ONE_PASS = True            # rows up to ONE_PASS_MAX wide (padded) in one launch, the row held in registers
ONE_PASS_MAX = 32768
ROW_WARPS = 16             # warps of a one-pass program
_ONES: dict[torch.device, torch.Tensor] = {}   # the unit scale per device, made outside any graph capture
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}   # `fuse_projections`' groups
FUSE_COPIES = True         # the engine's default: one FP8 copy (and GEMM) a q/k/v or gate/up group (`fuse_fp8_copies`)


def quantize_rows(w: torch.Tensor, out: torch.Tensor | None = None, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, s) with w ≈ w8 * s[:, None]: E4M3 rows scaled by each row's largest magnitude. With `out` / `scale`,
    written into them in place (the engine's re-quantisation keeps its tensors' addresses)."""
    wf = w.detach().float()
    s = wf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (wf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if out is None:
        return q, s
    out.copy_(q)
    scale.copy_(s)
    return out, scale


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, *,
               rowwise: bool | None = None) -> torch.Tensor:
    """`linear(x, w8 * w_scale[:, None], bias)` with x quantised per token: one FP8 GEMM, the output in x's dtype
    (`rowwise`: `scaled_linear`'s)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x8, x_scale = quantize_rows(x.reshape(-1, k))
    return scaled_linear(x8, x_scale, w8, w_scale, bias, x.dtype, rowwise=rowwise).view(*lead, w8.shape[0])


def scaled_linear(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype, *, rowwise: bool | None = None) -> torch.Tensor:
    """(x8 * x_scale[:, None]) @ (w8 * w_scale[:, None]).T + bias in `dtype`, x8 (M, K) and w8 (N, K) in E4M3.
    `rowwise` (None: `ROWWISE_GEMM`): on a GPU, the scales inside cuBLAS's row-wise GEMM rather than after it."""
    if x8.device.type == "cuda" and (ROWWISE_GEMM if rowwise is None else rowwise):
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale.unsqueeze(-1), scale_b=w_scale.unsqueeze(0),
                             out_dtype=dtype, use_fast_accum=FAST_ACCUM)
    elif x8.device.type == "cuda":
        y = dequantize(unit_product(x8, w8, dtype), x_scale, w_scale, dtype)
    else:   # the same product in float32 (CPU `_scaled_mm` takes row-wise scales only from torch 2.13)
        y = ((x8.float() * x_scale.unsqueeze(-1)) @ (w8.float() * w_scale.unsqueeze(-1)).t()).to(dtype)
    return y if bias is None else y + bias


def unit_product(x8: torch.Tensor, w8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x8 @ w8.T of E4M3 operands with unit scales, rounded to `dtype` (cuBLAS's tensor-wise FP8 GEMM on a GPU; in
    float32 elsewhere): the scales multiply after (`dequantize`)."""
    if x8.device.type == "cuda":
        one = unit_scale(x8.device)
        return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=FAST_ACCUM)
    return (x8.float() @ w8.float().t()).to(dtype)


def dequantize(y: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A unit-scale product's rows times x_scale, its columns times w_scale, in float32, rounded to `dtype`."""
    return (y.float() * x_scale.unsqueeze(-1) * w_scale).to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in their dtype (the MLP's own form)."""
    return nn.functional.silu(gate) * up


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, scales: tuple[torch.Tensor, ...] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(swiglu(gate, up))` over gate and up (M, I) (unit column stride each: two tensors, or the halves
    of a fused gate/up output). With `scales` (x_scale (M,), gate_scale (I,), up_scale (I,)), gate and up are unit-
    scale FP8 products (`unit_product`), each `dequantize`d first. On a GPU (or Triton's CPU interpreter) in the
    launches of the module doc, every intermediate rounded to their dtype as the torch form rounds it; else in torch."""
    if triton is None or not (gate.is_cuda or _interpreted()):
        if scales is not None:
            sx, sg, su = (t.reshape(-1) for t in scales)
            gate, up = (dequantize(t.reshape(-1, t.shape[-1]), sx, s, t.dtype) for t, s in ((gate, sg), (up, su)))
        return quantize_rows(swiglu(gate, up).reshape(-1, gate.shape[-1]))
    return _swiglu_quantize_op(gate, up, *(scales if scales is not None else (None, None, None)))


def _interpreted() -> bool:
    from lathe.engine.triton_decode import interpreted
    return interpreted()


def _spans(rows: int, width: int) -> tuple[int, int, int]:
    """(spans per row, span width, block) of `swiglu_quantize`'s launches over rows of `width` columns: one span of
    the whole row (padded to a power of two) in one launch when `ONE_PASS` and it is at most `ONE_PASS_MAX` wide;
    else about 1024 programs in all (up to 16 spans a row, each of at least 1024 columns), each span a whole number
    of blocks and none past the row's end, in two launches."""
    whole = triton.next_power_of_2(width)
    if ONE_PASS and whole <= ONE_PASS_MAX:
        return 1, whole, whole
    spans = 1
    while spans < 16 and rows * spans < 1024 and width // (spans * 2) >= 1024:
        spans *= 2
    block = min(1024, whole)
    span = triton.cdiv(triton.cdiv(width, spans), block) * block
    return triton.cdiv(width, span), span, block


if triton is not None:
    @triton.jit
    def _swiglu_span(G, U, SX, SG, SU, row, start, offs, cols_total, stride_g, stride_u, SCALED: tl.constexpr):
        """SiLU(gate) * up over columns start + offs of `row`, each step rounded to U's dtype as the torch form
        rounds it (with SCALED, gate and up first dequantised: (raw * sx[row]) * s[col]), in fp32."""
        cols = start + offs
        ok = cols < cols_total
        g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0)
        u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0)
        if SCALED:
            sx = tl.load(SX + row)
            g = (g.to(tl.float32) * sx * tl.load(SG + cols, mask=ok, other=0.0)).to(u.dtype)
            u = (u.to(tl.float32) * sx * tl.load(SU + cols, mask=ok, other=0.0)).to(u.dtype)
        g = g.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(u.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype).to(tl.float32), cols, ok

    @triton.jit
    def _quantize_span(h, scale, Q, row, cols, ok, stride_q, FP8_MAX: tl.constexpr):
        q = tl.minimum(tl.maximum(h / scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)         # (a NaN activation stays NaN, as in torch)
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_row_kernel(G, U, SX, SG, SU, Q, S, cols_total, stride_g, stride_u, stride_q, SCALED: tl.constexpr,
                           BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
        """The one-pass form: a program holds its whole row's SwiGLU while it finds the maximum, then quantises."""
        row = tl.program_id(0).to(tl.int64)                # (row x stride passes 2**31 at ~57k rows)
        h, cols, ok = _swiglu_span(G, U, SX, SG, SU, row, 0, tl.arange(0, BLOCK), cols_total, stride_g, stride_u,
                                   SCALED)
        top = tl.max(tl.maximum(tl.abs(h), 0.0), 0)       # (a NaN drops out of the maximum, as in the spans' form)
        scale = tl.maximum(top, 1e-12) / FP8_MAX
        tl.store(S + row, scale)
        _quantize_span(h, scale, Q, row, cols, ok, stride_q, FP8_MAX)

    @triton.jit
    def _swiglu_amax_kernel(G, U, SX, SG, SU, PART, cols_total, stride_g, stride_u, SCALED: tl.constexpr,
                            SPANS: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        row, span = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        top = tl.zeros([BLOCK], tl.float32)
        for start in range(span * WIDTH, span * WIDTH + WIDTH, BLOCK):
            h, cols, ok = _swiglu_span(G, U, SX, SG, SU, row, start, offs, cols_total, stride_g, stride_u, SCALED)
            top = tl.maximum(top, tl.abs(h))
        tl.store(PART + row * SPANS + span, tl.max(top, 0))

    @triton.jit
    def _swiglu_quant_kernel(G, U, SX, SG, SU, PART, Q, S, cols_total, stride_g, stride_u, stride_q,
                             SCALED: tl.constexpr, SPANS: tl.constexpr, SPANS_PAD: tl.constexpr, WIDTH: tl.constexpr,
                             BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
        row, span = tl.program_id(0).to(tl.int64), tl.program_id(1)
        parts = tl.arange(0, SPANS_PAD)
        top = tl.max(tl.load(PART + row * SPANS + parts, mask=parts < SPANS, other=0.0), 0)
        scale = tl.maximum(top, 1e-12) / FP8_MAX
        if span == 0:
            tl.store(S + row, scale)
        offs = tl.arange(0, BLOCK)
        for start in range(span * WIDTH, span * WIDTH + WIDTH, BLOCK):
            h, cols, ok = _swiglu_span(G, U, SX, SG, SU, row, start, offs, cols_total, stride_g, stride_u, SCALED)
            _quantize_span(h, scale, Q, row, cols, ok, stride_q, FP8_MAX)

    def _rows(t: torch.Tensor) -> torch.Tensor:
        """t as (M, I) with unit column stride (a view where it can be)."""
        t = t.reshape(-1, t.shape[-1])
        return t if t.stride(-1) == 1 else t.contiguous()

    def _launch_swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, scales: tuple[torch.Tensor, ...] | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = _rows(gate), _rows(up)
        rows, width = g.shape
        q = torch.empty(rows, width, dtype=FP8, device=g.device)
        s = torch.empty(rows, dtype=torch.float32, device=g.device)
        if rows == 0:
            return q, s
        sx, sg, su = (t.reshape(-1).contiguous() for t in scales) if scales is not None else (s, s, s)
        common = dict(SCALED=scales is not None)
        spans, span, block = _spans(rows, width)
        if spans == 1 and span == block:
            _swiglu_row_kernel[(rows,)](g, u, sx, sg, su, q, s, width, g.stride(0), u.stride(0), q.stride(0),
                                        BLOCK=block, FP8_MAX=FP8_MAX, num_warps=ROW_WARPS, **common)
            return q, s
        part = torch.empty(rows, spans, dtype=torch.float32, device=g.device)
        _swiglu_amax_kernel[(rows, spans)](g, u, sx, sg, su, part, width, g.stride(0), u.stride(0), SPANS=spans,
                                           WIDTH=span, BLOCK=block, **common)
        _swiglu_quant_kernel[(rows, spans)](g, u, sx, sg, su, part, q, s, width, g.stride(0), u.stride(0),
                                            q.stride(0), SPANS=spans, SPANS_PAD=triton.next_power_of_2(spans),
                                            WIDTH=span, BLOCK=block, FP8_MAX=FP8_MAX, **common)
        return q, s

    # One operator, opaque to torch.compile: a compiled layer calls it without a graph break (the fake gives shapes).
    @torch.library.custom_op("lathe::swiglu_quantize_fp8", mutates_args=())
    def _swiglu_quantize_op(gate: torch.Tensor, up: torch.Tensor, x_scale: Optional[torch.Tensor],
                            gate_scale: Optional[torch.Tensor], up_scale: Optional[torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        scales = None if x_scale is None else (x_scale, gate_scale, up_scale)
        return _launch_swiglu_quantize(gate, up, scales)

    @_swiglu_quantize_op.register_fake
    def _(gate, up, x_scale, gate_scale, up_scale):
        rows = gate.numel() // gate.shape[-1]
        return gate.new_empty(rows, gate.shape[-1], dtype=FP8), gate.new_empty(rows, dtype=torch.float32)


def _fuses_swiglu(x: torch.Tensor) -> bool:
    return FUSED_SWIGLU and x.is_cuda


def _gate_up_fp8(mlp: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """((w8, ...), (scale, ...)) of an MLP's gate and up FP8 copies: two each (`gate_proj`, `up_proj`), or one fused
    (`gate_up`); None when they are not FP8 or have a bias (the one-kernel form takes neither)."""
    w8 = getattr(mlp, "gate_up_fp8", None)
    if w8 is not None:
        return ((w8,), (mlp.gate_up_scale,)) if mlp.gate_up_bias is None else None
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not all(isinstance(p, Fp8Linear) and p.bias is None for p in (gate, up)):
        return None
    return (gate.weight_fp8, up.weight_fp8), (gate.weight_scale, up.weight_scale)


def mlp_down(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down_proj(hidden(x)) of an MLP whose down projection is an `Fp8Linear`. With `FUSED_SWIGLU` on a GPU and FP8
    gate/up: x quantised once, gate and up as unit-scale FP8 products, and their dequantisation, the SwiGLU and the
    down projection's input quantisation in `swiglu_quantize`'s kernel; else the torch form, which a compiled layer
    leaves to inductor."""
    down, lead = mlp.down_proj, x.shape[:-1]
    parts = _gate_up_fp8(mlp) if _fuses_swiglu(x) else None
    if parts is None:
        h = mlp.hidden(x)
        x8, sx = quantize_rows(h.reshape(-1, h.shape[-1]))
    else:
        xin8, sxin = quantize_rows(x.reshape(-1, x.shape[-1]))
        raw = [unit_product(xin8, w8, x.dtype) for w8 in parts[0]]
        (gate, up), (sg, su) = (raw, parts[1]) if len(raw) == 2 else (raw[0].chunk(2, -1), parts[1][0].chunk(2))
        x8, sx = swiglu_quantize(gate, up, (sxin, sg, su))
    y = scaled_linear(x8, sx, down.weight_fp8, down.weight_scale, down.bias, x.dtype)
    return y.view(*lead, y.shape[-1])


class Fp8MLP(MLP):
    """A plain (unfused) `MLP` whose down projection is an `Fp8Linear` (`mlp_down`); `quantize_model` swaps an MLP's
    class to it, as `fuse_projections` swaps to `FusedMLP`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_down(self, x)


def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`, one tensor per device (`quantize_model` makes it before any graph captures it)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), device=device)
    return one


class Fp8Linear(nn.Linear):
    """An `nn.Linear` of the engine's decoder layers that multiplies with its FP8 copy (`weight_fp8`,
    `weight_scale`, non-persistent buffers: the state dict keeps the bf16 weight under its Hugging Face name)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias)


class Fp8Head(Fp8Linear):
    """An FP8 lm_head (`quantize_lm_head`): on a GPU the scales multiply inside cuBLAS's row-wise GEMM, so its wide
    output (the vocabulary) is written once, not rescaled after in another pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, rowwise=True)


def project(owner: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The fused projection `<name>_weight` of `owner` (`decode_forms.fuse_projections`) applied to x: with its FP8
    copy when `quantize_model` made one, else in the weights' dtype."""
    w8 = getattr(owner, f"{name}_fp8", None)
    bias = getattr(owner, f"{name}_bias")
    if w8 is not None:
        return fp8_linear(x, w8, getattr(owner, f"{name}_scale"), bias)
    return nn.functional.linear(x, getattr(owner, f"{name}_weight"), bias)


def _aligned(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0


def _targets(model: nn.Module):
    """(owner, kind, name) of every projection to quantise: ("fused", "qkv"/"gate_up") for a fused one, ("copy",
    "qkv"/"gate_up") for a group whose FP8 copy alone is fused (`add_fused_copy`), ("linear", attribute) for a plain
    `nn.Linear` of a layer's attention or dense MLP."""
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            if block is layer.mlp and not isinstance(block, MLP):
                continue                       # a mixture of experts: its own grouped forward, left in bf16
            fused = set()
            for name, parts in FUSED.items():
                if isinstance(getattr(block, f"{name}_weight", None), torch.Tensor):
                    fused.update(parts)
                    yield block, "fused", name
                elif getattr(block, f"{name}_fp8", None) is not None:
                    fused.update(parts)
                    yield block, "copy", name
            for attr, child in block.named_children():
                if type(child) in (nn.Linear, Fp8Linear) and attr not in fused:
                    yield child, "linear", attr
    if type(getattr(model, "lm_head", None)) is Fp8Head:       # (`quantize_lm_head`)
        yield model.lm_head, "linear", "lm_head"


def copy_groups(model: nn.Module):
    """(owner, name, linears) of each q/k/v or gate/up group of plain, aligned `nn.Linear`s in a layer's own
    attention or dense MLP: what `decode_forms.fuse_fp8_copies` gives one FP8 copy (`add_fused_copy`)."""
    for layer in model.model.layers:
        for block, name in ((layer.self_attn, "qkv"), (layer.mlp, "gate_up")):
            if type(block) not in (Attention, MLP):
                continue                # (another family's attention, a mixture of experts: their own forward)
            linears = [getattr(block, part, None) for part in FUSED[name]]
            if all(type(lin) is nn.Linear and _aligned(lin.weight) for lin in linears) \
                    and len({(lin.bias is None, lin.weight.dtype) for lin in linears}) == 1:   # (biases: all or none)
                yield block, name, linears


def add_fused_copy(owner: nn.Module, name: str, linears: list[nn.Linear]) -> int:
    """One FP8 copy of `linears` (their rows stacked: `<name>_fp8`, `<name>_scale`, and `<name>_bias` copied) on
    `owner`, whose `<name>_weight` is None (the bf16 weights stay the linears' own); returns the bytes added."""
    w = linears[0].weight
    rows = sum(lin.weight.shape[0] for lin in linears)
    bias = None if linears[0].bias is None else torch.empty(rows, dtype=linears[0].bias.dtype, device=w.device)
    owner.register_buffer(f"{name}_weight", None, persistent=False)
    owner.register_buffer(f"{name}_fp8", torch.empty(rows, w.shape[1], dtype=FP8, device=w.device), persistent=False)
    owner.register_buffer(f"{name}_scale", torch.empty(rows, dtype=torch.float32, device=w.device), persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)
    unit_scale(w.device)
    _fill_copy(owner, name)
    return sum(t.nbytes for t in (getattr(owner, f"{name}_fp8"), getattr(owner, f"{name}_scale"), bias)
               if t is not None)


def _fill_copy(owner: nn.Module, name: str) -> None:
    """Quantise a fused FP8 copy's parts into their rows of it (and copy their biases into its bias), in place."""
    linears = [getattr(owner, part) for part in FUSED[name]]
    w8, scale, bias = (getattr(owner, f"{name}_{kind}") for kind in ("fp8", "scale", "bias"))
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.weight.shape[0])
        quantize_rows(lin.weight, out=w8[rows], scale=scale[rows])
        if bias is not None:
            bias[rows].copy_(lin.bias.detach())
        start = rows.stop


def quantize_model(model: nn.Module) -> int:
    """Give every projection of `model`'s decoder layers an FP8 copy that its forward uses (see the module
    docstring); returns the bytes added. Call `fuse_projections` (or `fuse_fp8_copies`) first when the engine fuses."""
    added = 0
    for owner, kind, name in _targets(model):
        if kind == "copy":
            continue
        w = owner.weight if kind == "linear" else getattr(owner, f"{name}_weight")
        unit_scale(w.device)
        if not _aligned(w):
            continue
        w8, s = quantize_rows(w)
        prefix = "weight" if kind == "linear" else name
        owner.register_buffer(f"{prefix}_fp8", w8, persistent=False)
        owner.register_buffer(f"{prefix}_scale", s, persistent=False)
        if type(owner) is nn.Linear:        # (an engine built again on a quantised model keeps its classes)
            owner.__class__ = Fp8Linear
        added += w8.nbytes + s.nbytes
    for layer in model.model.layers:
        if type(layer.mlp) is MLP and isinstance(layer.mlp.down_proj, Fp8Linear):
            layer.mlp.__class__ = Fp8MLP
    return added


def quantize_lm_head(model: nn.Module) -> int:
    """An FP8 copy of `model.lm_head` that its forward uses (`rollout.quantize_lm_head`, an option beside
    quantization=fp8): the sampler's logits then come from an FP8 product of the final norm's output, per token and
    per vocabulary row as the projections are. Its weight (tied to the embedding or not) stays the model's. Call after
    `quantize_model`; returns the bytes added."""
    head = model.lm_head
    if type(head) not in (nn.Linear, Fp8Head) or not _aligned(head.weight):
        shape = tuple(head.weight.shape) if isinstance(getattr(head, "weight", None), torch.Tensor) else None
        raise ValueError(f"rollout.quantize_lm_head: this lm_head ({type(head).__name__}, weight {shape}) cannot "
                         f"take an FP8 copy: it needs a plain linear layer whose vocabulary and hidden sizes are "
                         f"multiples of {ALIGN}. Fix: set actor_rollout_ref.rollout.quantize_lm_head=false")
    unit_scale(head.weight.device)
    w8, s = quantize_rows(head.weight)
    head.register_buffer("weight_fp8", w8, persistent=False)
    head.register_buffer("weight_scale", s, persistent=False)
    head.__class__ = Fp8Head
    return w8.nbytes + s.nbytes


@torch.no_grad()
def requantize(model: nn.Module, names: set[str] | None = None) -> None:
    """Quantise the current weights into the FP8 copies again, in place (after a weight update); with `names` (the
    Hugging Face names of the tensors updated), only the projections they touch."""
    paths = {id(m): p for p, m in model.named_modules()} if names is not None else {}
    for owner, kind, name in _targets(model):
        prefix = "weight" if kind == "linear" else name
        w8 = getattr(owner, f"{prefix}_fp8", None)
        if w8 is None:
            continue
        if names is not None:
            path = paths[id(owner)]
            sources = ([f"{path}.weight"] if kind == "linear" else
                       [f"{path}.{part}.{t}" for part in FUSED[name] for t in ("weight", "bias")])
            if name == "lm_head" and owner.weight is model.model.embed_tokens.weight:
                sources.append("model.embed_tokens.weight")      # (tied: a sync may name the embedding only)
            if not names.intersection(sources):
                continue
        if kind == "copy":
            _fill_copy(owner, name)
            continue
        w = owner.weight if kind == "linear" else getattr(owner, f"{name}_weight")
        quantize_rows(w, out=w8, scale=getattr(owner, f"{prefix}_scale"))


def check_device(device: torch.device, dtype: torch.dtype, *, key: str = "actor_rollout_ref.rollout.quantization",
                 dtype_key: str = "actor_rollout_ref.rollout.dtype") -> None:
    """FP8 GEMMs on CUDA need an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper) and bf16 outputs (the
    row-wise scaled product's only output type); the CPU takes any dtype (its product is emulated in float32).
    `key` / `dtype_key`: the settings the errors name (the engine's by default)."""
    if device.type != "cuda":
        return
    capability = nvidia_capability(device)
    if capability is None or capability < (8, 9):
        raise ValueError(f"{key}=fp8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper) for FP8 "
                         f"matrix products; this one reports {capability}. Fix: set {key}=null")
    if dtype != torch.bfloat16:
        raise ValueError(f"{key}=fp8 on CUDA computes in bfloat16 (the FP8 product's output type), but the model is "
                         f"{dtype}. Fix: set {dtype_key}=bfloat16, or {key}=null")


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(owner, "weight_fp8" if kind == "linear" else f"{name}_fp8", None) is not None
               for owner, kind, name in _targets(model))
