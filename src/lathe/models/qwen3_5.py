"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next in lathe's decoder: hybrid stacks of gated-DeltaNet layers and gated full
attention (`LatheConfig.linear_attention`, `lathe.models.hybrid_config`).

What differs from Qwen3 (as transformers' `modeling_qwen3_next` / `modeling_qwen3_5` compute it):
- the decoder layers' norms, the final norm and q/k norms are zero-centred: x / rms(x) * (1 + w), in float32;
- full attention (`self_attn`): `q_proj` gives each head's query and an output gate side by side (2 * head_dim);
  the heads' outputs are multiplied by sigmoid(gate) before `o_proj`; RoPE turns the first `rotary_dim` features;
- linear attention (`linear_attn`): projections to q, k, v (through a short causal depthwise convolution and SiLU),
  z (the output gate), b (beta = sigmoid(b)) and a (g = -exp(A_log) * softplus(a + dt_bias)); the gated delta rule
  (`lathe.models.linear_attention`); an RMSNorm over each value head gated by silu(z); `out_proj`.
  Qwen3.5 names its projections `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next fuses them into
  `in_proj_qkvz` and `in_proj_ba`, laid out per key head ([q, k, v-group, z-group] and [b-group, a-group]);
- MoE layers (Qwen3.5-MoE, Qwen3-Next): `lathe.models.moe`'s routed experts plus a shared SwiGLU expert scaled by
  sigmoid(`shared_expert_gate`(x)).

Parameter names are the checkpoints' own. The linear-attention layers see each packed sequence (or each row of a
padded batch, padding zeroed as transformers does) from a zero state. Under Ulysses sequence parallelism (an attention
callable with `to_heads` / `to_tokens` around a `PackedAttention`: `lathe.train.ulysses.UlyssesAttention`) each rank
projects its slice of the tokens, and an all-to-all hands it the whole stream for a share of the key heads (each with
its r = Hv / Hk value heads: the convolution is per channel and the delta rule per head, so heads are independent);
the outputs go back to the slice before the gated norm (`GatedDeltaNet.head_parallel`). Prefix grouping
(`actor.use_prefix_grouper`) runs each prompt once and each response from its prompt's final states
(`GatedDeltaNet.grouped`). An attention callable that carries `linear_states` (the
engine's step: `cu_seqlens`, `max_seqlen`, and `read()` / `write(conv, recurrent)` of the next linear layer's
per-sequence states, called in layer order) has each sequence continue from its own states instead; a step of one
token per sequence hands the state updates to it (`GatedDeltaNet.step`), which advances them in place.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from lathe.models.attention import GroupedAttention, GroupedLinear, PackedAttention, PaddedAttention
from lathe.models.config import LatheConfig
from lathe.models.decoder import MLP, RMSNorm, attend
from lathe.models.linear_attention import causal_conv1d, chunk_gated_delta_rule, conv_state, stepped
from lathe.models.moe import SparseMoeBlock
from lathe.models.rope import RotaryEmbedding, apply_rotary


class ZeroCenteredRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, cast back (weight starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm over the last dimension, then times silu(gate) in float32 (`linear_attn.norm`)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * nn.functional.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate, zero-centred q/k norms and partial RoPE (`self_attn`)."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim * 2, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        if attn.rotates:
            raise NotImplementedError("lathe's hybrid layers take q and k rotated; an attention that rotates them "
                                      "itself (the engine's decode step) does not run Qwen3.5 / Qwen3-Next")
        lead = x.shape[:-1]
        q, gate = self.q_proj(x).view(*lead, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(*lead, self.n_kv, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        out = attend(attn, q, k, v, torch.compiler.is_compiling())
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (`linear_attn`); module doc."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        la, h = cfg.linear_attention, cfg.hidden_size
        self.la = la
        self.n_k, self.n_v = la.num_key_heads, la.num_value_heads      # the heads it runs (fewer on a rank of a
        self.key_dim, self.value_dim = self.n_k * la.key_head_dim, self.n_v * la.value_head_dim    # TP group)
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, la.conv_kernel, groups=conv_dim, bias=False,
                                padding=la.conv_kernel - 1)
        if la.projections == "split":
            self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, la.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(h, la.num_value_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * la.num_value_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def project(self, x: torch.Tensor):
        """(mixed q|k|v before the convolution (..., conv_dim), z (..., Hv, Dv), b and a (..., Hv))."""
        la = self.la
        if la.projections == "split":
            z = self.in_proj_z(x).unflatten(-1, (self.n_v, la.value_head_dim))
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        lead, r = x.shape[:-1], self.n_v // self.n_k
        qkvz = self.in_proj_qkvz(x).view(*lead, self.n_k, -1)
        q, k, v, z = qkvz.split([la.key_head_dim, la.key_head_dim, r * la.value_head_dim, r * la.value_head_dim], -1)
        b, a = self.in_proj_ba(x).view(*lead, self.n_k, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        return (mixed, z.reshape(*lead, self.n_v, la.value_head_dim), b.reshape(*lead, -1), a.reshape(*lead, -1))

    def conv_weight(self) -> torch.Tensor:
        """The depthwise convolution's weight (conv_dim, K) over the [q | k | v] channels `project` gives."""
        return self.conv1d.weight.squeeze(1)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, state=None):
        """A packed stream x (T, H) of sequences delimited by `cu_seqlens`, each from a zero state; or, given
        `state` = (convolution inputs (S, conv_dim, K-1), recurrent states (S, Hv, Dk, Dv)), each continuing from its
        own, and then returns (output, the final states in the same form): an inference step's form; (None, None):
        each from a zero state, returning the final states as well (the engine's step of fresh sequences)."""
        la = self.la
        mixed, z, b, a = self.project(x)
        conv = None if state is None else conv_state(mixed, cu_seqlens, la.conv_kernel, state[0])
        mixed = causal_conv1d(mixed, self.conv_weight(), cu_seqlens, None if state is None else state[0])
        o, final = chunk_gated_delta_rule(*self._qkv(mixed), *self._gates(b, a), cu_seqlens, max_seqlen,
                                          initial_state=None if state is None else state[1])
        out = self.out_proj(self.norm(o, z).flatten(-2))
        return out if state is None else (out, (conv, final))

    def grouped(self, x: torch.Tensor, lin: GroupedLinear) -> torch.Tensor:
        """The prefix-grouped stream x (T, H) (`lathe.train.prefix_group`): the prompts from a zero state, then
        each response from its prompt's final states: the recurrent state, and for the convolution the prompt's last
        K-1 inputs, run as a copy in front of the response (whose outputs are dropped). Every response token gets
        the inputs and state it has in its own row, so the outputs equal the per-row forward's up to rounding."""
        mixed, z, b, a = self.project(x)
        weight = self.conv_weight()
        g, beta = self._gates(b, a)
        tp = lin.prompt_tokens                      # the prompts lead the stream, the responses follow
        if tp == x.shape[0]:                        # no response token in the micro-batch
            o, _ = chunk_gated_delta_rule(*self._qkv(causal_conv1d(mixed, weight, lin.cu_prompt)), g, beta,
                                          lin.cu_prompt, lin.max_prompt)
            return self.out_proj(self.norm(o, z).flatten(-2))
        # one convolution over the prompts and, after them, each response behind its copy of its prompt's tail
        conv = causal_conv1d(torch.cat([mixed[:tp], mixed.index_select(0, lin.extended)]), weight, lin.cu_conv)
        o_prompt, final = chunk_gated_delta_rule(*self._qkv(conv[:tp]), g[:tp], beta[:tp], lin.cu_prompt,
                                                 lin.max_prompt)
        o_response, _ = chunk_gated_delta_rule(*self._qkv(conv[tp:].index_select(0, lin.kept)), g[tp:], beta[tp:],
                                               lin.cu_response, lin.max_response,
                                               initial_state=final.index_select(0, lin.group))
        return self.out_proj(self.norm(torch.cat([o_prompt, o_response]), z).flatten(-2))

    def head_parallel(self, x: torch.Tensor, split) -> torch.Tensor:
        """Ulysses: this rank's slice x (T/S, H) of a packed stream whose every sequence starts from a zero state.
        `split` (`UlyssesAttention`) exchanges (T/S tokens, Hk heads, ...) for (T tokens, Hk/S heads, ...) and back
        (`to_heads`, `to_tokens`), its `inner` holds the whole padded stream's `cu_seqlens`. Each key head's q, k,
        its value heads' v and b, a travel together (one all-to-all), so rank s runs the convolution and the delta
        rule over every token for key heads [s Hk/S, (s+1) Hk/S) and their value heads, with those channels'
        convolution weights and those heads' A_log, dt_bias. The outputs return to the token slice, where the
        gated norm (per token and value head) meets z, which never leaves the rank."""
        la, n, size, rank = self.la, x.shape[0], split.sp.size, split.sp.rank
        hk, r, dk, dv = self.n_k, self.n_v // self.n_k, la.key_head_dim, la.value_head_dim     # (a TP rank's: fewer)
        mixed, z, b, a = self.project(x)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        grouped = torch.cat([q.view(n, hk, dk), k.view(n, hk, dk), v.reshape(n, hk, r * dv), b.view(n, hk, r),
                             a.view(n, hk, r)], dim=-1)
        q, k, v, b, a = split.to_heads(grouped).split([dk, dk, r * dv, r, r], dim=-1)
        mine = hk // size
        keys, values = slice(rank * mine * dk, (rank + 1) * mine * dk), slice(rank * mine * r, (rank + 1) * mine * r)
        w = self.conv_weight()
        weight = torch.cat([w[keys], w[self.key_dim:][keys], w[2 * self.key_dim:][values.start * dv:values.stop * dv]])
        cu, longest = split.inner.cu_seqlens, split.inner.max_seqlen
        mixed = causal_conv1d(torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1), weight, cu)
        q, k, v = mixed.split([mine * dk, mine * dk, mine * r * dv], dim=-1)
        g, beta = self._gates(b.flatten(-2), a.flatten(-2), values)
        o, _ = chunk_gated_delta_rule(q.unflatten(-1, (mine, dk)), k.unflatten(-1, (mine, dk)),
                                      v.unflatten(-1, (mine * r, dv)), g, beta, cu, longest)
        return self.out_proj(self.norm(split.to_tokens(o), z).flatten(-2))

    def step(self, x: torch.Tensor, states) -> torch.Tensor:
        """One new token per sequence, x (S, H), each continuing from its own states, which `states` (the engine's
        `LinearStep`) advances where they lie: `conv_step(mixed, weight)` and `recurrent_step(q, k, v, g, beta)`.
        No host sync and no search over packed bounds: a CUDA graph captures it (`lathe.engine.cuda_graph`)."""
        mixed, z, b, a = self.project(x)
        mixed = states.conv_step(mixed, self.conv_weight())
        o = states.recurrent_step(*self._qkv(mixed), *self._gates(b, a))
        return self.out_proj(self.norm(o, z).flatten(-2))

    def _qkv(self, mixed: torch.Tensor):
        """q, k (..., Hk, Dk) and v (..., Hv, Dv) of the convolved projections."""
        la = self.la
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.unflatten(-1, (self.n_k, la.key_head_dim)) for t in (q, k))
        return q, k, v.unflatten(-1, (self.n_v, la.value_head_dim))

    def _gates(self, b: torch.Tensor, a: torch.Tensor, heads: slice = slice(None)):
        """(g, beta): the decay's log, -exp(A_log) softplus(a + dt_bias) in float32, and sigmoid(b); b, a of the
        value `heads` only (a rank's share under Ulysses)."""
        return (-self.A_log[heads].float().exp() * nn.functional.softplus(a.float() + self.dt_bias[heads]),
                torch.sigmoid(b))


class SharedExpertMoeBlock(SparseMoeBlock):
    """`lathe.models.moe`'s routed experts plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, cfg: LatheConfig):
        super().__init__(cfg)
        self.shared_expert = MLP(replace(cfg, intermediate_size=cfg.linear_attention.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block whose token mixer is `linear_attn` or `self_attn` (`layer_types`)."""

    def __init__(self, cfg: LatheConfig, index: int):
        super().__init__()
        self.linear = cfg.linear_attention.layer_types[index] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        if cfg.is_sparse_layer(index):
            self.mlp = SharedExpertMoeBlock(cfg) if cfg.linear_attention.shared_expert_intermediate_size else \
                SparseMoeBlock(cfg)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self._linear(h, attn) if self.linear else self.self_attn(h, cos, sin, attn))
        return x + self.mlp(self.post_attention_layernorm(x))

    def _linear(self, h: torch.Tensor, attn) -> torch.Tensor:
        out = stepped(self.linear_attn, h, attn)        # the engine's steps
        if out is not None:
            return out
        if isinstance(attn, PackedAttention):
            return self.linear_attn(h, attn.cu_seqlens, attn.max_seqlen)
        if isinstance(attn, GroupedAttention) and attn.linear is not None:      # actor.use_prefix_grouper
            return self.linear_attn.grouped(h, attn.linear)
        if hasattr(attn, "to_heads") and isinstance(attn.inner, PackedAttention):    # Ulysses (module doc)
            return self.linear_attn.head_parallel(h, attn)
        if isinstance(attn, PaddedAttention):
            b, length = h.shape[:2]
            if attn.attention_mask is not None:      # padding zeroed: it leaves the state untouched (as transformers)
                h = h * attn.attention_mask.unsqueeze(-1).to(h.dtype)
            return self.linear_attn(h.reshape(b * length, -1), attn.row_bounds(b, length, h.device), length).view_as(h)
        raise NotImplementedError(
            f"lathe's Qwen3.5 / Qwen3-Next linear-attention layers run packed, padded or prefix-grouped batches (the "
            f"grouped one with its `GroupedLinear` layout); got {type(attn).__name__}"
            + (" without one" if isinstance(attn, GroupedAttention) else ""))


def hybrid_parts(cfg: LatheConfig) -> tuple[nn.ModuleList, nn.Module, RotaryEmbedding]:
    """(layers, final norm, rotary embedding over the rotated features) of a hybrid `LatheDecoderModel`."""
    layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
    rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
    return layers, ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), rotary


def init_hybrid_weights(model: nn.Module) -> None:
    """The initialisation transformers gives the hybrid-only parameters: zero-centred norms at 0, dt_bias at 1,
    A_log = log(uniform(0.01, 16)), gated norms at 1 (`lathe.models.decoder.init_weights` does the rest)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                m.weight.zero_()
            elif isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.01, 16).log())
                m.norm.weight.fill_(1.0)
