"""lathe's decoder: Llama 3.x, Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm) in one module tree.

Module and parameter names are those of the Hugging Face checkpoints (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, ..., `lm_head.weight`), so a state dict moves between the
two with no renaming. Only the math lives here: no KV cache, paging, sharding or optimizer.

Two forward forms share the layers:
- `forward(input_ids, attention_mask, position_ids)`: a padded (B, L) batch, as transformers takes it;
  returns an object with `.logits` (B, L, V) (or `.hidden_states` with `return_hidden=True`).
- `forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)`: T tokens of S sequences laid end to
  end, causal within each; returns the final hidden states (T, H). No padding is ever computed.
The rollout engine's decode and prefill steps run the same layers in a split form (`DecoderLayer.split_forward`,
asked for by an attention with `split_k`): each layer's residual adds are left to the norm that follows, and the
down projection may run as partial products over chunks of K (`split_linear`).

Training may compile the decoder layers of one model instance (`lathe.models.compile.compile_decoder`);
the attention call always runs eager (`_attend`), so every backend and batch layout works the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lathe.models.attention import PackedAttention, PaddedAttention, select_packed_backend
from lathe.models.config import LatheConfig
from lathe.models.packing import pack_padded, position_ids_from_mask, unpack_to_padded
from lathe.models.rope import RotaryEmbedding, apply_rotary


@torch.compiler.disable
def _attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mark_dynamic: bool = False,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`attn(q, k, v)` with the heads flattened, (..., Hq * D), always run eager: the attention callables hold
    per-batch Python state (sequence bounds, a KV cache, a layer counter) that would make a compiled layer
    recompile for every batch. Eager callers pay well under a microsecond for the wrapper. From a compiled
    layer (`mark_dynamic`), the output's token dims are marked dynamic like the layer's inputs, so the graph
    after attention also compiles once for all lengths. `rope`: (cos, sin) for an attention that rotates q and
    k itself (`attn.rotates`: the engine's decode step, which does it in its KV store's launch)."""
    out = (attn(q, k, v) if rope is None else attn(q, k, v, *rope)).flatten(-2)
    if mark_dynamic:
        _mark_token_dims_dynamic(out)
    return out


def _mark_token_dims_dynamic(*tensors: torch.Tensor) -> None:
    """Tell torch.compile that the leading (token) dimensions change from batch to batch, so the layers compile
    once for all packed lengths instead of once per length; feature dimensions stay static."""
    for t in tensors:
        for dim in range(t.dim() - 1):
            torch._dynamo.maybe_mark_dynamic(t, dim)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.register_buffer("gate_up_weight", None, persistent=False)    # set by fuse_projections
        self.register_buffer("gate_up_bias", None, persistent=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), the down projection's input."""
        if self.gate_up_weight is not None:       # fused (`fuse_projections`): one matmul for gate and up
            gate, up = nn.functional.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
            return nn.functional.silu(gate) * up
        return nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; the batch layout is the `attn` callable's business."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.register_buffer("qkv_weight", None, persistent=False)        # set by fuse_projections
        self.register_buffer("qkv_bias", None, persistent=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool = True):
        """(q, k, v), each (..., heads, head_dim), q/k normed (Qwen3) and rotated (unless not `rotate`)."""
        lead = x.shape[:-1]
        if self.qkv_weight is not None:           # fused (`fuse_projections`): one matmul for q, k and v
            kv = self.n_kv * self.head_dim
            q, k, v = nn.functional.linear(x, self.qkv_weight, self.qkv_bias).split(
                [self.n_heads * self.head_dim, kv, kv], dim=-1)
            q, k, v = (t.reshape(*lead, -1, self.head_dim) for t in (q, k, v))
        else:
            q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
            v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotate:
            return q, k, v
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        return self.o_proj(_attend(attn, *self.project(x, cos, sin)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        # self_attn's steps spelled out here, so that in a compiled layer the graph breaks at `_attend` in this
        # frame: one graph before attention, one after, every input of both marked dynamic
        rotates = getattr(attn, "rotates", False)      # the attention applies RoPE itself
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin, rotate=not rotates)
        x = x + self.self_attn.o_proj(_attend(attn, q, k, v, torch.compiler.is_compiling(),
                                              (cos, sin) if rotates else None))
        return x + self.mlp(self.post_attention_layernorm(x))

    def split_forward(self, x: torch.Tensor, part: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, attn,
                      splits: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for the rollout engine's steps, with o_proj and down_proj as split-K matmuls
        (`split_linear`, `splits` = their K splits): the residual add of the down projection is left to the
        next layer (`part`, this layer's (S, T, H) partial products, None before the first layer), where summing
        the partials, adding the residual and the input norm are one kernel of the compiled layer; o_proj's sum
        and residual add fold into the post-attention norm the same way. Returns (x before the pending add,
        the down projection's partials). Why: the plain form's `x + linear(...)` compiles to a cuBLAS addmm, which
        copies the residual into its output first (two device-to-device copies a layer) and leaves the final norm
        to eager kernels; and at a few hundred rows a long-K matmul fills few of the GPU's SMs (1.5B down: 96 tiles
        of 64x64 for 132 SMs, each looping over K=8960), where cuBLAS's own split-K would need a reduction launch of
        its own."""
        if part is not None:
            x = _add_partials(x, part)
        rotates = getattr(attn, "rotates", False)
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin, rotate=not rotates)
        out = _attend(attn, q, k, v, torch.compiler.is_compiling(), (cos, sin) if rotates else None)
        x = _add_partials(x, split_linear(out, self.self_attn.o_proj, splits[0]))
        return x, split_linear(self.mlp.hidden(self.post_attention_layernorm(x)), self.mlp.down_proj, splits[1])


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


def _add_partials(x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """x + part.sum(0), added up in float32 in a fixed order and rounded once: written as a chain of adds (the split
    count is static) so that the compiled layer folds it into the norm that follows; inductor makes `sum(0)` a
    reduction kernel of its own."""
    total = x.float()
    for p in part.unbind(0):
        total = total + p.float()
    return total.to(x.dtype)


def _split_final(norm: RMSNorm, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The last layer's pending residual add and the final norm (one kernel when compiled)."""
    return norm(_add_partials(x, part))


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
    """One matmul for each layer's q/k/v projections and one for gate/up, as vLLM's QKV and merged column layers.
    For inference (the rollout engine): a decode step of a small model is made of small, latency-bound matmuls, and
    each one saved is a launch saved. Groups holding a subclass of `nn.Linear` (LoRA layers) are left as they are. The fused tensors are new memory; the layers' old tensors are freed unless
    something else (a trainer sharing them) still holds them."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name, linears in ((attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
                                     (mlp, "gate_up", (mlp.gate_proj, mlp.up_proj))):
            if all(type(lin) is nn.Linear for lin in linears):     # a LoRA layer's own forward must run: kept
                _fuse(owner, name, linears)


def projection_bytes(model: nn.Module) -> int:
    """Bytes of the weights `fuse_projections` concatenates (q, k, v, gate, up of every layer)."""
    parts = [(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in model.model.layers]
    parts += [(layer.mlp, ("gate_proj", "up_proj")) for layer in model.model.layers]
    return sum(getattr(owner, name).weight.nbytes for owner, names in parts for name in names)


class LatheDecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    compile_backend: str | None = None   # set on an instance by compile_decoder: its layers run under torch.compile
    # the split-K decode form (`DecoderLayer.split_forward`, `_split_final`): compiled by compile_decoder
    split_step = staticmethod(DecoderLayer.split_forward)
    split_final = staticmethod(_split_final)

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn) -> torch.Tensor:
        """Final-norm hidden states for tokens of any leading shape, attention given by `attn`."""
        x = self.embed_tokens(input_ids)
        rope = getattr(attn, "rope", None)        # the engine's decode graph looks its rows up in a table
        cos, sin = rope if rope is not None else self.rotary_emb(position_ids, x.dtype)
        if self.compile_backend is not None:
            _mark_token_dims_dynamic(x, cos, sin)
        splits = getattr(attn, "split_k", None)       # the engine's steps: (o_proj, down_proj) K splits
        if splits is not None:
            part = None
            for layer in self.layers:
                x, part = self.split_step(layer, x, part, cos, sin, attn, splits)
                if self.compile_backend is not None:
                    _mark_token_dims_dynamic(x)
                    torch._dynamo.maybe_mark_dynamic(part, 1)
            return self.split_final(self.norm, x, part)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
        return self.norm(x)


@dataclass
class CausalLMOutput:
    """What `LatheCausalLM.forward` returns: `.logits` like transformers, or `.hidden_states` alone."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class _Backbone(nn.Module):
    """Shared by the LM and the value model: config, backbone, layout dispatch and HF-style switches."""

    attn_backend: str = "auto"      # packed attention: "auto" | "varlen" | "sdpa"
    padded_attention: str = "auto"  # padded batches: "auto" | "mask" | "unpad"

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.config = cfg
        self.model = LatheDecoderModel(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def compile_backend(self) -> str | None:
        """The torch.compile backend of this instance's layers (and of its log-prob chunk math); None = eager."""
        return self.model.compile_backend

    def packed_backend(self) -> str:
        return select_packed_backend(self.attn_backend, self.device, self.dtype)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder layer in backward (same name as transformers' switch)."""
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    def save_pretrained(self, path, *, max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write config.json and safetensors weights that transformers' `AutoModelForCausalLM` (the LM) or
        `AutoModelForTokenClassification` (the value model) loads; `state_dict` replaces the module's own tensors
        (a mixed-precision trainer saves its fp32 masters)."""
        from lathe.models.io import save_pretrained
        save_pretrained(self, path, max_shard_size=max_shard_size, state=state_dict)

    def hidden_packed(self, input_ids, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
        """(T, H) final hidden states of a packed stream."""
        return self._hidden_packed(input_ids, position_ids, cu_seqlens, max_seqlen)

    def _hidden_packed(self, input_ids, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
        attn = PackedAttention(cu_seqlens.to(input_ids.device), int(max_seqlen), self.packed_backend())
        return self.model(input_ids, position_ids, attn)

    def hidden_padded(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """(B, L, H) final hidden states of a padded batch; padding positions hold unspecified values."""
        return self._hidden_padded(input_ids, attention_mask, position_ids)

    # The public entry points (forward, hidden_padded, hidden_packed) never call one another: a sharding wrapper
    # may hook each of them (FSDP2's register_fsdp_forward_method), and hooks must not nest.
    def _hidden_padded(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        if attention_mask is None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return self.model(input_ids, position_ids, PaddedAttention(None))
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        mode = self.padded_attention
        if mode == "auto":
            mode = "unpad" if self.packed_backend() == "varlen" else "mask"
        if mode == "mask":
            return self.model(input_ids, position_ids, PaddedAttention(attention_mask))
        if mode != "unpad":
            raise ValueError(f"padded_attention={mode!r} is unknown; use 'auto', 'mask' or 'unpad'")
        packed = pack_padded(input_ids, attention_mask, position_ids)
        hidden = self._hidden_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
        return unpack_to_padded(hidden, packed)


class LatheCausalLM(_Backbone):
    """Decoder plus `lm_head` (tied to `model.embed_tokens` when the config says so)."""

    def __init__(self, cfg: LatheConfig):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the very tensor of `model.embed_tokens.weight` when embeddings are tied."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, use_cache: bool = False,
                return_hidden: bool = False) -> CausalLMOutput:
        """Padded forward, called like a transformers causal LM. `use_cache` is accepted and ignored."""
        hidden = self._hidden_padded(input_ids, attention_mask, position_ids)
        if return_hidden:
            return CausalLMOutput(hidden_states=hidden)
        return CausalLMOutput(logits=self.lm_head(hidden))

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int, *, return_hidden: bool = True) -> torch.Tensor:
        """Packed forward: hidden (T, H) by default, logits (T, V) with `return_hidden=False`."""
        hidden = self.hidden_packed(input_ids, position_ids, cu_seqlens, max_seqlen)
        return hidden if return_hidden else self.lm_head(hidden)


@dataclass
class ValueOutput:
    """Like transformers' TokenClassifierOutput: `.logits` (B, L, 1) are the values."""

    logits: torch.Tensor


class LatheValueModel(_Backbone):
    """The critic: the decoder backbone and a `score` Linear(hidden, 1) head (verl's token-classification critic)."""

    def __init__(self, cfg: LatheConfig, *, score_bias: bool = True):
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=score_bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, use_cache: bool = False) -> ValueOutput:
        return ValueOutput(logits=self.score(self._hidden_padded(input_ids, attention_mask, position_ids)))

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int) -> torch.Tensor:
        """Values (T,) of a packed stream."""
        return self.score(self.hidden_packed(input_ids, position_ids, cu_seqlens, max_seqlen)).squeeze(-1)


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Random initialisation as transformers does it: normal(0, std) matrices, zero biases, unit norms."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
