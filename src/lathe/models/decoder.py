"""lathe's decoder: Llama 3.x, Mistral, Seed-OSS, Qwen2/2.5 (q/k/v bias; MiMo is Qwen2 plus multi-token-prediction
layers, `lathe.models.mtp`), Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3 with mixture-of-experts MLPs, `lathe.models.moe`),
GPT-OSS (attention sinks, sliding-window layers, its own MoE: `lathe.models.gpt_oss`), GLM-4 (partial RoPE, norms on
the attention's and MLP's outputs: `lathe.models.glm4`) and GLM-4.5 (partial RoPE, DeepSeek-V3's MoE:
`lathe.models.deepseek.DeepseekMoeBlock`) in one module tree; the hybrid linear-attention families
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next) bring their own layers (`lathe.models.qwen3_5`), and so does the DeepSeek-V3
family (latent attention, its MoE: `lathe.models.deepseek`).

Module and parameter names are those of the Hugging Face checkpoints (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, ..., `lm_head.weight`), so a state dict moves between the
two with no renaming; where a family's checkpoints differ (other names: `io.HUB_NAMES`; per-expert tensors, fused
here; GLM-4's interleaved RoPE pairs and fused gate/up: `lathe.models.glm4`), `lathe.models.io` converts them on
reading and writing. Only the math lives here: no KV cache, paging, sharding or optimizer.

Two forward forms share the layers:
- `forward(input_ids, attention_mask, position_ids)`: a padded (B, L) batch, as transformers takes it;
  returns an object with `.logits` (B, L, V) (or `.hidden_states` with `return_hidden=True`).
- `forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)`: T tokens of S sequences laid end to
  end, causal within each; returns the final hidden states (T, H). No padding is ever computed.
How the rollout engine runs these layers in its steps (fused projections, split-K layers, RoPE rows looked up from
a table) is the engine's business: `lathe.engine.decode_forms`.

The attention is a callable handed to the layers (`lathe.models.attention.AttentionFn`): it takes q, k, v and
returns the heads' outputs; one whose `rotates` is true also takes (cos, sin) and rotates q and k itself.

Training may compile the decoder layers of one model instance (`lathe.models.compile.compile_decoder`);
the attention call always runs eager (`attend`), so every backend and batch layout works the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lathe.models.attention import FLASH_BACKENDS, PackedAttention, PaddedAttention, refuse_layer_options, \
    select_packed_backend
from lathe.models.config import LatheConfig
from lathe.models.gpt_oss import GptOssMoeBlock
from lathe.models.moe import SparseMoeBlock
from lathe.models.packing import pack_padded, position_ids_from_mask, unpack_to_padded
from lathe.models.rope import RotaryEmbedding, apply_rotary


@torch.compiler.disable
def attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mark_dynamic: bool = False,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None, options: dict | None = None) -> torch.Tensor:
    """`attn(q, k, v)` with the heads flattened, (..., Hq * D), always run eager: the attention callables hold
    per-batch Python state (sequence bounds, a KV cache, a layer counter) that would make a compiled layer
    recompile for every batch. Eager callers pay well under a microsecond for the wrapper. From a compiled
    layer (`mark_dynamic`), the output's token dims are marked dynamic like the layer's inputs, so the graph
    after attention also compiles once for all lengths. `rope`: (cos, sin) for an attention that rotates q and
    k itself (`attn.rotates`). `options`: the layer's sinks and sliding window (`Attention.options`), or None."""
    options = options or {}
    refuse_layer_options(attn, options)
    out = (attn(q, k, v, **options) if rope is None else attn(q, k, v, *rope, **options)).flatten(-2)
    if mark_dynamic:
        mark_token_dims_dynamic(out)
    return out


def mark_token_dims_dynamic(*tensors: torch.Tensor) -> None:
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

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dimension, in float32."""
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), the down projection's input."""
        return nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; the batch layout is the `attn` callable's business. GPT-OSS: a learned
    sink logit per head (`sinks`) and, in its sliding layers, a window (`options`)."""

    def __init__(self, cfg: LatheConfig, index: int = 0):
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
        self.window = cfg.window_of(index)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.n_heads))

    def options(self) -> dict | None:
        """What this layer hands its attention callable besides q, k, v: `sinks` and `window`, or None."""
        sinks = getattr(self, "sinks", None)
        if sinks is None and self.window is None:
            return None
        return {"sinks": sinks, "window": self.window}

    def qkv(self, x: torch.Tensor):
        """The projections (q, k, v), each (..., heads, head_dim)."""
        lead = x.shape[:-1]
        return (self.q_proj(x).view(*lead, self.n_heads, self.head_dim),
                self.k_proj(x).view(*lead, self.n_kv, self.head_dim),
                self.v_proj(x).view(*lead, self.n_kv, self.head_dim))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool = True):
        """(q, k, v), each (..., heads, head_dim), q/k normed (Qwen3) and rotated (unless not `rotate`)."""
        q, k, v = self.qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotate:
            return q, k, v
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        return self.o_proj(attend(attn, *self.project(x, cos, sin), options=self.options()))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)); the MLP is a mixture of experts in the sparse
    layers of a MoE model (`index`: the layer's place in the stack). GLM-4's (`cfg.post_norms`) norms the attention's
    and the MLP's outputs too before each residual add (`post_self_attn_layernorm`, `post_mlp_layernorm`)."""

    def __init__(self, cfg: LatheConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.mlp = sparse_block(cfg)(cfg) if cfg.is_sparse_layer(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.post_norms:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        # self_attn's steps spelled out here, so that in a compiled layer the graph breaks at `attend` in this
        # frame: one graph before attention, one after, every input of both marked dynamic
        rotates = attn.rotates      # the attention applies RoPE itself
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin, rotate=not rotates)
        out = self.self_attn.o_proj(attend(attn, q, k, v, torch.compiler.is_compiling(),
                                           (cos, sin) if rotates else None, self.self_attn.options()))
        if hasattr(self, "post_self_attn_layernorm"):       # GLM-4
            x = x + self.post_self_attn_layernorm(out)
            return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x))


def sparse_block(cfg: LatheConfig) -> type[SparseMoeBlock]:
    """The module class of the family's sparse MLP: GPT-OSS's (clamped SwiGLU, biases), DeepSeek-V3's (sigmoid
    group-limited routing, shared experts: GLM-4.5's) or Qwen3-MoE's."""
    if cfg.moe.swiglu_limit is not None:
        return GptOssMoeBlock
    if cfg.moe.scoring == "sigmoid":
        from lathe.models.deepseek import DeepseekMoeBlock      # (it imports this module)
        return DeepseekMoeBlock
    return SparseMoeBlock


class LatheDecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    compile_backend: str | None = None   # set on an instance by compile_decoder: its layers run under torch.compile
    compile_mode: str | None = None      # and inductor's mode it gave them (the engine's split decode forms use it too)

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.linear_attention is not None:        # Qwen3.5 / Qwen3-Next hybrids: `lathe.models.qwen3_5`
            from lathe.models.qwen3_5 import hybrid_parts
            self.layers, self.norm, self.rotary_emb = hybrid_parts(cfg)
        elif cfg.mla is not None:                   # DeepSeek-V3 family: `lathe.models.deepseek`
            from lathe.models.deepseek import deepseek_parts
            self.layers, self.norm, self.rotary_emb = deepseek_parts(cfg)
        elif cfg.nemotron is not None:              # Nemotron-H: `lathe.models.nemotron_h`
            from lathe.models.nemotron_h import nemotron_parts
            self.layers, self.norm, self.rotary_emb = nemotron_parts(cfg)
        else:
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
        if cfg.num_mtp_layers:                      # MiMo: run by training only (`lathe.models.mtp.mtp_stream`)
            from lathe.models.mtp import mtp_layers
            self.mtp_layers = mtp_layers(cfg)
        self.gradient_checkpointing = False
        self.gradient_checkpointing_layers: int | None = None     # see `recomputes`

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn) -> torch.Tensor:
        """Final-norm hidden states for tokens of any leading shape, attention given by `attn`."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        if self.compile_backend is not None:
            mark_token_dims_dynamic(x, cos, sin)
        for i, layer in enumerate(self.layers):
            if recomputes(self, i):
                x = checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
        return self.norm(x)


def recomputes(stack: nn.Module, index: int) -> bool:
    """Whether layer `index` of `stack` (a decoder stack: `LatheDecoderModel`, the VL language model; MTP layers
    numbered after the stack's own, `lathe.models.mtp`) recomputes its activations in this backward: gradient
    checkpointing on, a training forward under autograd, and `index` among the first `gradient_checkpointing_layers`
    (None: every layer). Megatron's `recompute_method=block` picks layers the same way: the first layers' activations
    live longest (saved first, freed last in backward), so recomputing those lowers the peak most per layer; the
    later ones keep their activations and skip the second forward. A count past the layers recomputes every one."""
    if not (stack.gradient_checkpointing and stack.training and torch.is_grad_enabled()):
        return False
    return stack.gradient_checkpointing_layers is None or index < stack.gradient_checkpointing_layers


def set_checkpointing(stack: nn.Module, on: bool, layers: int | None) -> None:
    """Set a decoder stack's switches (`recomputes`); `layers` must be None or >= 0."""
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise ValueError(f"gradient checkpointing layers={layers!r}: give a count of layers >= 0, or None (every "
                         "layer)")
    stack.gradient_checkpointing, stack.gradient_checkpointing_layers = on, layers if on else None


@dataclass
class CausalLMOutput:
    """What `LatheCausalLM.forward` returns: `.logits` like transformers, or `.hidden_states` alone."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class _Backbone(nn.Module):
    """Shared by the LM and the value model: config, backbone, layout dispatch and HF-style switches."""

    attn_backend: str = "auto"      # packed attention: "auto" | "varlen" | "fa4" | "sdpa" (`set_attention`)
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

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, *,
                                      layers: int | None = None) -> None:
        """Recompute decoder layers in backward (same name as transformers' switch): every layer, or with `layers`
        the first `layers` only (`recomputes`)."""
        set_checkpointing(self.model, True, layers)

    def gradient_checkpointing_disable(self) -> None:
        set_checkpointing(self.model, False, None)

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

    def hidden_with(self, input_ids, position_ids, attn) -> torch.Tensor:
        """Final hidden states of tokens of any leading shape under an attention callable bound to their layout
        (`lathe.models.attention.AttentionFn`), such as one that training builds around `PackedAttention` to split
        a packed stream over devices (`lathe.train.ulysses`)."""
        return self.model(input_ids, position_ids, attn)

    def hidden_grouped(self, input_ids, position_ids, attn) -> torch.Tensor:
        """(T, H) final hidden states of the prefix-grouped stream of `lathe.train.prefix_group` under its
        `GroupedAttention` (each prompt once, each response over its prompt and itself)."""
        return self.model(input_ids, position_ids, attn)

    # The public entry points (forward, hidden_padded, hidden_packed, hidden_with, hidden_grouped) never call one
    # another: a sharding wrapper may hook each of them (FSDP2's register_fsdp_forward_method), and hooks must not nest.
    def _hidden_padded(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        if attention_mask is None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return self.model(input_ids, position_ids, PaddedAttention(None))
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        mode = self.padded_attention
        if mode == "auto":
            mode = "unpad" if self.packed_backend() in FLASH_BACKENDS else "mask"
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
        elif isinstance(module, Attention) and getattr(module, "sinks", None) is not None:
            nn.init.normal_(module.sinks, mean=0.0, std=std)
        if isinstance(module, GptOssMoeBlock):
            module.init_weights(std)
        elif isinstance(module, SparseMoeBlock) and hasattr(module.experts, "gate_up_proj"):
            for p in (module.gate.weight, module.experts.gate_up_proj, module.experts.down_proj):
                nn.init.normal_(p, mean=0.0, std=std)
    if getattr(getattr(model, "config", None), "linear_attention", None) is not None:
        from lathe.models.qwen3_5 import init_hybrid_weights
        init_hybrid_weights(model)
    if getattr(getattr(model, "config", None), "nemotron", None) is not None:
        from lathe.models.nemotron_h import init_nemotron_weights
        init_nemotron_weights(model, std)
