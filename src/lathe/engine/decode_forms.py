"""How the engine runs lathe's text decoder in its prefill and decode steps; the decoder itself says only what it
computes (`lathe.models.decoder`).

Two forms, each the same math as the decoder's plain forward, arranged for a step of inference:
- fused projections (`fuse_projections`): one matmul for each layer's q/k/v and one for gate/up, as vLLM's QKV and
  merged column layers. A decode step of a small model is made of small, launch-bound matmuls; each one saved is a
  launch saved. The layers' modules become `FusedAttention` / `FusedMLP`, which compute their projections from the
  concatenated weights; the parameters stay, as views of them, under their Hugging Face names.
- split-K layers (`split_layer`, asked for by a step attention's `split_k`): each layer's residual adds are left to
  the norm that follows, and o_proj and down_proj may run as partial products over chunks of their input features
  (`split_linear`). Compiled, the deferred adds fold into the norms' kernels instead of a cuBLAS addmm that copies
  the residual first; and at a few hundred rows a projection with a long K and few output tiles keeps only part of
  the GPU busy, which K chunks spread over more of it without a reduction launch of their own.
  `step_split_k` decides, per step, whether and how much to split.

`text_hidden` is the engine's forward of the text decoder: the decoder's embeddings, RoPE (or the step's RoPE rows,
looked up by the decode graph: `step.rope`), layers and final norm, in the form the step attention asks for.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lathe.device import multiprocessor_count
from lathe.engine import fp8
from lathe.engine.fp8 import project
from lathe.models.decoder import MLP, Attention, DecoderLayer, LatheDecoderModel, RMSNorm, attend, \
    mark_token_dims_dynamic

# ---- fused projections -------------------------------------------------------------------------------------------


class FusedAttention(Attention):
    """`Attention` whose q/k/v come from one matmul over `qkv_weight` (and `qkv_bias`), set by `fuse_projections`
    (in FP8 with `lathe.engine.fp8`)."""

    def qkv(self, x: torch.Tensor):
        lead, kv = x.shape[:-1], self.n_kv * self.head_dim
        q, k, v = project(self, "qkv", x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        return tuple(t.reshape(*lead, -1, self.head_dim) for t in (q, k, v))


class FusedMLP(MLP):
    """`MLP` whose gate and up come from one matmul over `gate_up_weight` (and `gate_up_bias`); with an FP8 down
    projection, `fp8.mlp_down`."""

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.swiglu(*project(self, "gate_up", x).chunk(2, dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.down_proj, fp8.Fp8Linear):
            return fp8.mlp_down(self, x)
        return self.down_proj(self.hidden(x))


def _fuse(owner: nn.Module, name: str, linears: tuple[nn.Linear, ...]) -> None:
    """Concatenate `linears`' weights (and biases) into `owner.<name>_weight` / `_bias` (non-persistent buffers) and
    make each layer's own parameters views of them: the state dict keeps its HF names, and a weight copied into
    `q_proj.weight` (an engine's weight sync) lands in the fused tensor."""
    for part in ("weight", "bias"):
        tensors = [getattr(lin, part) for lin in linears]
        if tensors[0] is None:
            owner.register_buffer(f"{name}_{part}", None, persistent=False)
            continue
        fused = torch.cat([t.detach() for t in tensors])
        owner.register_buffer(f"{name}_{part}", fused, persistent=False)
        start = 0
        for lin, t in zip(linears, tensors):
            getattr(lin, part).data = fused[start:start + t.shape[0]]
            start += t.shape[0]


def fuse_projections(model: nn.Module) -> None:
    """One matmul for each layer's q/k/v projections and one for gate/up (see the module docstring), in place: each
    fused module's class becomes `FusedAttention` / `FusedMLP` (as FSDP2's `fully_shard` swaps a module's class), so
    the layers' forward, compiled or not, runs the fused matmul. Groups holding a subclass of `nn.Linear` (LoRA
    layers) are left as they are: their own forward must run; so are a MoE model's sparse MLPs, whose experts'
    gate and up are one stacked tensor already (`lathe.models.moe`). The fused tensors are new memory; the layers' old
    tensors are freed unless something else (a trainer sharing them) still holds them."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj), FusedAttention)]
        if isinstance(mlp, MLP):
            groups.append((mlp, "gate_up", (mlp.gate_proj, mlp.up_proj), FusedMLP))
        for owner, name, linears, fused in groups:
            if all(type(lin) is nn.Linear for lin in linears):
                _fuse(owner, name, linears)
                owner.__class__ = fused


def fuse_fp8_copies(model: nn.Module) -> int:
    """The FP8 form of `fuse_projections` for a model whose bf16 weights stay separate: each q/k/v and gate/up group
    of plain linears gets one FP8 copy of its rows (`fp8.add_fused_copy`; the bf16 weights remain the layers' own
    tensors, nothing copied) and its module the fused class, so the group is one FP8 GEMM. Call before
    `fp8.quantize_model`, which quantises the rest; returns the bytes added."""
    added = 0
    for owner, name, linears in list(fp8.copy_groups(model)):
        added += fp8.add_fused_copy(owner, name, linears)
        owner.__class__ = FusedAttention if name == "qkv" else FusedMLP
    return added


def projection_bytes(model: nn.Module) -> int:
    """Bytes of the weights `fuse_projections` concatenates (q, k, v of every layer, gate and up of its dense MLPs)."""
    parts = [(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in model.model.layers]
    parts += [(layer.mlp, ("gate_proj", "up_proj")) for layer in model.model.layers if isinstance(layer.mlp, MLP)]
    return sum(getattr(owner, name).weight.nbytes for owner, names in parts for name in names)


# ---- split-K layers ----------------------------------------------------------------------------------------------


def split_linear(x: torch.Tensor, linear: nn.Linear, splits: int) -> torch.Tensor:
    """`linear(x)` as `splits` partial products over equal chunks of the input features: (splits, *x's lead, N),
    summing to `linear(x)` (up to rounding: each partial is rounded to x's dtype). One batched matmul, no copies (the
    chunks are strided views of x and of the weight). A linear with a bias, a subclass (LoRA: its own forward
    must run), a weight that is not contiguous (viewing its chunks would copy it), one split, or features that do
    not divide evenly: `linear(x)` as a single partial."""
    k = x.shape[-1]
    if splits <= 1 or type(linear) is not nn.Linear or linear.bias is not None or k % splits \
            or not linear.weight.is_contiguous():
        return linear(x).unsqueeze(0)
    n, c = linear.weight.shape[0], k // splits
    a = x.reshape(-1, splits, c).transpose(0, 1)                    # (S, T, c)
    b = linear.weight.view(n, splits, c).permute(1, 2, 0)           # (S, c, N)
    return torch.bmm(a, b).view(splits, *x.shape[:-1], n)


def add_partials(x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """x + part.sum(0), added up in float32 in a fixed order and rounded once: written as a chain of adds (the split
    count is static) so that the compiled layer folds it into the norm that follows; inductor makes `sum(0)` a
    reduction kernel of its own."""
    return _chain_f32(x, *part.unbind(0)).to(x.dtype)


def _chain_f32(*tensors: torch.Tensor) -> torch.Tensor:
    """The sum of `tensors` in float32, added in their order (an unrolled chain of adds: see `add_partials`)."""
    total = tensors[0].float()
    for t in tensors[1:]:
        total = total + t.float()
    return total


def split_layer(layer: DecoderLayer, x: torch.Tensor, part: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn, splits: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer.forward` with o_proj and down_proj as split-K matmuls (`split_linear`, `splits` = their K splits): the
    residual add of the down projection is left to the next layer (`part`, this layer's (S, T, H) partial products,
    None before the first layer), where summing the partials, adding the residual and the input norm are one kernel
    of the compiled layer; o_proj's sum and residual add fold into the post-attention norm the same way. Returns
    (x before the pending add, the down projection's partials). GLM-4's layers (a norm on each output,
    `LatheConfig.post_norms`) norm the summed partials before the add: the pending add is then one normed partial."""
    if part is not None:
        x = add_partials(x, part)
    rotates = attn.rotates
    q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin, rotate=not rotates)
    out = attend(attn, q, k, v, torch.compiler.is_compiling(), (cos, sin) if rotates else None,
                 layer.self_attn.options())
    post = getattr(layer, "post_self_attn_layernorm", None)
    out = split_linear(out, layer.self_attn.o_proj, splits[0])
    x = add_partials(x, out) if post is None else x + post(sum_partials(out))
    h = layer.post_attention_layernorm(x)
    if not isinstance(layer.mlp, MLP) or isinstance(layer.mlp.down_proj, fp8.Fp8Linear):
        # a mixture of experts (`lathe.models.moe`), or an FP8 down projection (`fp8.mlp_down`): one partial
        down = layer.mlp(h).unsqueeze(0)
    else:
        down = split_linear(layer.mlp.hidden(h), layer.mlp.down_proj, splits[1])
    return x, down if post is None else layer.post_mlp_layernorm(sum_partials(down)).unsqueeze(0)


def sum_partials(part: torch.Tensor) -> torch.Tensor:
    """part.sum(0) in float32 in a fixed order, rounded once (`add_partials` without the residual)."""
    return _chain_f32(*part.unbind(0)).to(part.dtype)


def split_final(norm: RMSNorm, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The last layer's pending residual add and the final norm (one kernel when compiled)."""
    return norm(add_partials(x, part))


@functools.cache
def _compiled_split_forms(backend: str, mode: str | None = None):
    """`split_layer` and `split_final` compiled with `backend` in inductor's `mode` (the decoder's, `compile_decoder`):
    one code object each for every layer of every model, so a model's layers share their compiled variants."""
    return (torch.compile(split_layer, backend=backend, mode=mode),
            torch.compile(split_final, backend=backend, mode=mode))


def text_hidden(decoder: LatheDecoderModel, input_ids: torch.Tensor, position_ids: torch.Tensor, step) -> torch.Tensor:
    """Final-norm hidden states of an engine step through lathe's text decoder: `step` is the step's attention
    (`step_attention`), whose `rope` (the step's (cos, sin) rows, or None: computed from `position_ids`) and `split_k`
    (the layers' split form, or None: their plain forward) say how the layers run. The decoder's compiled layers
    (`compile_decoder`) run compiled here too, and so does the split form, with the same backend and mode."""
    x = decoder.embed_tokens(input_ids)
    cos, sin = step.rope if step.rope is not None else decoder.rotary_emb(position_ids, x.dtype)
    compiled = decoder.compile_backend is not None
    if compiled:
        mark_token_dims_dynamic(x, cos, sin)
    if step.split_k is None:
        for layer in decoder.layers:
            x = layer(x, cos, sin, step)
        return decoder.norm(x)
    layer_form, final_form = (_compiled_split_forms(decoder.compile_backend, decoder.compile_mode) if compiled
                              else (split_layer, split_final))
    part = None
    for layer in decoder.layers:
        x, part = layer_form(layer, x, part, cos, sin, step, step.split_k)
        if compiled:
            mark_token_dims_dynamic(x)
            torch._dynamo.maybe_mark_dynamic(part, 1)
    return final_form(decoder.norm, x, part)


# ---- when to split -----------------------------------------------------------------------------------------------


def step_split_k(model, rows: int, prefill: bool = False) -> tuple[int, int] | None:
    """The (o_proj, down_proj) K splits of an engine step of `rows` tokens (`split_layer`): a decode step's
    sequences, or a prefill step's new tokens (`prefill`), which always get (1, 1): the split form without splits,
    whose residual adds fold into the norms instead of cuBLAS addmm's copies; or None for the layers' plain forward.
    The split form pays only where its adds fold into the norms: for lathe's text decoder compiled (`compile_decoder`,
    as the engine does on CUDA), in half precision, on CUDA.

    Why no K splits at prefill: each split pair is a compiled variant of the layers. The decode graphs' capture
    compiles the decode steps' pairs at start-up; a prefill of a few hundred tokens (prompts found in the prefix
    cache, a small admission) would compile one of its own the first time it met it, which costs far more than the
    split saves on a few percent of one step's layers."""
    decoder = model.model
    if not isinstance(decoder, LatheDecoderModel) or decoder.compile_backend is None or model.dtype == torch.float32 \
            or getattr(model.config, "mla", None) is not None \
            or getattr(model.config, "linear_attention", None) is not None \
            or getattr(model.config, "nemotron", None) is not None:   # DeepSeek-V3's, the hybrids', Nemotron-H's
        return None                                                    # layers have no split form
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda":
        return None
    if prefill:
        return (1, 1)
    cfg, sms = model.config, multiprocessor_count(device)
    return (_splits_for(rows, cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, sms),
            _splits_for(rows, cfg.intermediate_size, cfg.hidden_size, sms))


def _splits_for(rows: int, k: int, n: int, num_sms: int) -> int:
    """K splits of a decode projection of `k` input and `n` output features at `rows` rows: none under 192 rows
    (cuBLAS's own choice is as fast or faster); 4 where the output has fewer 64x64 tiles than the GPU has SMs, 2
    where it has up to twice as many, none beyond (the GPU is busy already); never chunks under 2048 features (too
    short a loop to pay for the extra partial). The thresholds come from timing the layers' step without attention
    on a GPU."""
    if rows < 192:
        return 1
    tiles = -(-rows // 64) * -(-n // 64)
    for s in ((4, 2) if tiles < num_sms else (2,) if tiles < 2 * num_sms else ()):
        if k % s == 0 and k // s >= 2048:
            return s
    return 1
