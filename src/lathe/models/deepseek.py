"""The DeepSeek-V3 family (`DeepseekV3ForCausalLM`: DeepSeek-V3, Moonlight, Kimi-K2) in lathe's decoder: multi-head
latent attention and its MoE (`LatheConfig.mla`, `lathe.models.deepseek_config`), as transformers'
`modeling_deepseek_v3` computes them, under the checkpoints' own parameter names.

Multi-head latent attention (`self_attn`), per token:
- q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) when `q_lora_rank` is null), per head [nope | rope];
- [c | k_rope] = kv_a_proj_with_mqa(x); [k_nope | v] per head = kv_b_proj(kv_a_layernorm(c)); k_rope is one head,
  shared by all;
- RoPE turns the rope parts only (q's per head, k's shared one), in DeepSeek's interleaved pair layout when
  `rope_interleave` (pairs (x0, x1), (x2, x3), ... each turned by one frequency; the result laid out as the halves
  [even | odd], on q and k alike, which the dot products do not see);
- softmax(q k^T * scale) v with scale = qk_head_dim^-0.5 times YaRN's mscale^2 (`MlaConfig.softmax_scale`).
The attention callables of lathe (packed, padded, the engine's paged steps) take q, k, v of one head width and scale
by its inverse square root: the shorter of k and v is zero-padded to the longer, both up to a multiple of 8 (zeros
add nothing to q k^T; v's zero columns are sliced off the output), and q is multiplied by softmax_scale * sqrt(width) when that is not 1. The
trainer's forward takes that form; lathe's engine caches each token's latent instead and attends in the absorbed form
(`MlaAttention.absorbed`, `lathe.engine.mla`: kv_lora_rank + qk_rope_head_dim values per token and layer instead of
heads * 2 * width).

The MoE (`mlp` of the layers from `first_k_dense_replace` on; the earlier ones have a dense SwiGLU `mlp`): sigmoid
scores s = sigmoid(x W^T) in float32; expert selection uses s + `e_score_correction_bias` (DeepSeek's auxiliary-loss-
free balancing bias, a buffer), restricted to the `topk_group` of `n_group` expert groups with the largest sum of
their two best biased scores; the chosen experts' weights are the unbiased s, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`. The routed experts are `lathe.models.moe`'s (stacked tensors, per-expert names on disk); a
shared SwiGLU expert (`shared_experts`, width moe_intermediate_size * n_shared_experts) adds to every token.
transformers' DeepseekV3 keeps the router weight and bias in float32 in a bfloat16 model; lathe keeps the bias in
float32 (`DeepseekRouter`) and casts the weight with the model (the router's arithmetic is float32 either way).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from lathe.models.config import LatheConfig
from lathe.models.decoder import MLP, RMSNorm, attend
from lathe.models.moe import Experts, SparseMoeBlock, TopKRouter, sorted_forward
from lathe.models.rope import RotaryEmbedding, apply_rotary


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (..., heads, d) whose pairs are interleaved (x0, x1), (x2, x3), ...; cos/sin (..., d) as
    `RotaryEmbedding` gives them (the angles twice over). The result is laid out [turned evens | turned odds]."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class MlaAttention(nn.Module):
    """Multi-head latent attention (module doc), `self_attn`."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        m, h = cfg.mla, cfg.hidden_size
        self.m, self.n_heads, self.width = m, cfg.num_attention_heads, m.attn_dim
        qk = m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)       # transformers' default eps, as it builds it
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.n_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * m.v_head_dim, h, bias=cfg.o_bias)
        q_scale = m.softmax_scale * self.width ** 0.5          # 1 unless YaRN's mscale or padding changes it
        self.q_scale = 1.0 if abs(q_scale - 1.0) < 1e-12 else q_scale

    def queries_and_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_nope (..., heads, qk_nope), q_rope (..., heads, rope) rotated, the normed latent (..., kv_lora_rank),
        k_rope (..., 1, rope) rotated): what both forms of the attention start from."""
        m, lead = self.m, x.shape[:-1]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(*lead, self.n_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim],
                                                                         dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        rotate = apply_interleaved_rotary if m.rope_interleave else apply_rotary
        return q_nope, rotate(q_rope, cos, sin), self.kv_a_layernorm(latent), rotate(k_rope.unsqueeze(-2), cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v), each (..., heads, width): q and k rotated, padded and q scaled (module doc)."""
        m, lead = self.m, x.shape[:-1]
        q_nope, q_rope, latent, k_rope = self.queries_and_latent(x, cos, sin)
        kv = self.kv_b_proj(latent).view(*lead, self.n_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(*lead, self.n_heads, m.qk_rope_head_dim)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return _pad(q, self.width), _pad(k, self.width), _pad(v, self.width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        if attn.rotates:
            raise NotImplementedError("DeepSeek-V3's latent attention turns only the rope part of q and k, itself; "
                                      "an attention that rotates q and k (the engine's decode step) must be built "
                                      "with rotates=False for it")
        if getattr(attn, "latent", False):
            return self.absorbed(x, cos, sin, attn)
        out = attend(attn, *self.project(x, cos, sin), torch.compiler.is_compiling())
        out = out.unflatten(-1, (self.n_heads, self.width))[..., :self.m.v_head_dim]
        return self.o_proj(out.flatten(-2))


    def absorbed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """The same attention over the engine's latent cache (`lathe.engine.mla`): one key/value "head" per token,
        [normed latent c | rotated k_rope], shared by every query head. kv_b_proj's per-head maps are absorbed: head
        h's score is (q_nope W_UK[h]) . c + q_rope . k_rope, equal to q_nope . (W_UK[h] c) + q_rope . k_rope, and its
        output the attention-weighted c mapped by W_UV[h] afterwards, as (sum_j p_j c_j) W_UV[h]^T = sum_j p_j v_j."""
        m, r = self.m, self.m.kv_lora_rank
        q_nope, q_rope, latent, k_rope = self.queries_and_latent(x, cos, sin)
        w = self.kv_b_proj.weight.view(self.n_heads, m.qk_nope_head_dim + m.v_head_dim, r)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("...hn,hnr->...hr", q_nope, w_uk), q_rope], dim=-1)
        q = q * (m.softmax_scale * m.latent_dim ** 0.5)        # the kernels scale by latent_dim^-0.5
        kv = _pad(torch.cat([latent.unsqueeze(-2), k_rope], dim=-1), m.latent_dim)
        out = attend(attn, _pad(q, m.latent_dim), kv, kv, torch.compiler.is_compiling())
        out = out.unflatten(-1, (self.n_heads, m.latent_dim))[..., :r]
        return self.o_proj(torch.einsum("...hr,hvr->...hv", out, w_uv).flatten(-2))


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else nn.functional.pad(x, (0, width - x.shape[-1]))


class DeepseekRouter(TopKRouter):
    """`mlp.gate`: the router's (E, H) weight and the selection bias `e_score_correction_bias` (E,), a buffer as in
    transformers (saved, never trained). The bias stays float32 when the model is cast (`model.to(bfloat16)`) and when
    a checkpoint is read in another dtype (`lathe.models.io.read_state_dict`), as transformers keeps it: rounded to
    bfloat16 it would change which experts some tokens pick."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if bias.dtype == torch.float32 and moved.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(moved.device)
        return self


def group_limited_route(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                        norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, experts (T, k)) from the sigmoid scores (T, E) (module doc)."""
    t, e = scores.shape
    choice = scores + bias.float()
    if n_group > 1 and topk_group < n_group:
        groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)       # (T, G)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


class DeepseekMoeBlock(SparseMoeBlock):
    """A DeepSeek-V3-style sparse layer's MLP (DeepSeek-V3's, GLM-4.5's, HY-V3's: `MoeConfig.scoring == "sigmoid"`):
    routed experts (module doc) plus the shared experts. It adds no load-balancing loss (transformers' DeepseekV3,
    Glm4Moe and HYV3 have none): `collect_router_stats` records nothing for it. HY-V3's checkpoints name the router
    `mlp.router.gate`, the selection bias `mlp.expert_bias` and the shared experts `mlp.shared_mlp`
    (`lathe.models.io.HUB_NAMES` renames them on load and save)."""

    balance_losses = False

    def __init__(self, cfg: LatheConfig):
        nn.Module.__init__(self)
        self.moe, self.moe_hidden = cfg.moe, cfg.hidden_size
        self.gate = DeepseekRouter(cfg.hidden_size, cfg.moe.num_experts)
        self.experts = Experts(cfg.moe, cfg.hidden_size)
        if cfg.moe.n_shared_experts:
            width = cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts
            self.shared_experts = MLP(replace(cfg, intermediate_size=width, mlp_bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        weights, chosen = self.routed(flat)
        if self.decode_experts is not None:     # the engine's decode steps (`SparseMoeBlock.decode_experts`)
            out = self.decode_experts(flat, weights.to(x.dtype), chosen, self.experts.gate_up_proj,
                                      self.experts.down_proj).view(*lead, h)
        else:
            out = sorted_forward(flat, weights.to(x.dtype), chosen, self.experts).view(*lead, h)  # EP wraps experts
        return out + self.shared_experts(x) if self.moe.n_shared_experts else out

    def routed(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of the tokens `flat` (T, H): the sigmoid scores' group-limited choice, or routing
        replay's (recorded or given experts: `lathe.models.routing`)."""
        scores = torch.sigmoid(nn.functional.linear(flat.float(), self.gate.weight.float()))
        if self.hooks_routing:
            return self._hooked(scores, self.moe.norm_topk_prob, own=self.choose, weigh=self.weigh)
        return self.choose(scores)

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of the group-limited choice over the sigmoid `scores` (module doc)."""
        m = self.moe
        return group_limited_route(scores, self.gate.e_score_correction_bias, m.num_experts_per_tok, m.n_group,
                                   m.topk_group, m.norm_topk_prob, m.routed_scaling_factor)

    def weigh(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The weights of given experts: their scores (no bias), normalised when the family does, routed-scaled."""
        weights = scores.gather(1, chosen)
        if self.moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.moe.routed_scaling_factor


class MlaDecoderLayer(nn.Module):
    """Pre-norm residual block of latent attention and a dense or DeepSeek MoE MLP (`index`: the layer's place)."""

    def __init__(self, cfg: LatheConfig, index: int = 0):
        super().__init__()
        self.self_attn = MlaAttention(cfg)
        self.mlp = DeepseekMoeBlock(cfg) if cfg.is_sparse_layer(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def deepseek_parts(cfg: LatheConfig) -> tuple[nn.ModuleList, RMSNorm, RotaryEmbedding]:
    """(layers, final norm, rotary embedding of the rope part's width) of a DeepSeek-V3 decoder."""
    layers = nn.ModuleList(MlaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
    rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings)
    return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), rotary

