"""Multi-token-prediction (MTP) layers: XiaomiMiMo's MiMo (`MiMoForCausalLM`, a Qwen2 body plus MTP layers).

MTP layer k (0-based) of a packed stream of T tokens reads, at position t, the previous stream's hidden state h_t (the
main model's final-norm output for k = 0, MTP layer k-1's output after) and the embedding of token t+k+1, and its
output (through the shared `lm_head`) predicts token t+k+2. MiMo's layer, as its checkpoints name it
(`model.mtp_layers.<k>.*`):

    e = token_layernorm(embed_tokens(x_{t+k+1}))            RMSNorm
    h = hidden_layernorm(h_t)                               RMSNorm
    z = input_proj(concat[h, e])                            Linear(2H -> H), no bias; hidden state first
    z = z + self_attn(input_layernorm(z))                   Qwen2 attention (q/k/v bias), causal, same RoPE positions
    z = z + mlp(post_attention_layernorm(z))                SwiGLU
    out = final_layernorm(z)                                RMSNorm; feeds lm_head and the next MTP layer

The token ids are shifted within each packed sequence (Megatron's `roll_tensor` over packed sequences): a position
whose token t+k+1 lies past its sequence's end reads token 0, never the next sequence's first token; training masks
those positions' targets (`lathe.train.mtp`). The main model's forward is untouched: Qwen2's.

DeepSeek-V3's MTP layers (`model.layers.<num_hidden_layers + i>.{enorm,hnorm,eh_proj,shared_head.*}` around a full
MLA + MoE decoder layer, embedding first in the concatenation, and a per-layer copy of the embedding and head) are not
built here: lathe's DeepSeek-V3 decoder drops them on load with a warning (`lathe.models.io.load_into`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lathe.models.config import LatheConfig
from lathe.models.decoder import DecoderLayer, RMSNorm, recomputes

MTP_PREFIX = "model.mtp_layers."


def roll_packed(ids: torch.Tensor, cu_seqlens: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    """`ids` (T, ...) shifted one place left within each packed sequence: out[t] = ids[t+1], and each sequence's last
    position holds `fill` (never the next sequence's first element)."""
    out = torch.roll(ids, -1, 0)
    ends = cu_seqlens[1:].long() - 1
    out[ends[ends >= 0]] = fill
    return out


def mtp_stream(model, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor, attn, *, detach_encoder: bool = False,
               local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The MTP layers' outputs [(n, H)] * num_mtp_layers over a packed stream of T tokens: `input_ids` (T,) the
    stream's tokens, `cu_seqlens` its sequence bounds; `hidden` (n, H) the main model's final hidden states and
    `position_ids` (n,) the positions of the n tokens this process computes, `attn` the attention of the main forward
    (the same sequences and layout). `local` maps a whole-stream (T, ...) tensor to those n tokens (default: all of
    them); the ids are shifted over the whole stream before it, so a token shifted in from past the slice's end is
    there (a sequence-parallel rank's slice: `lathe.train.ulysses`, whose `attn` exchanges the heads).
    `detach_encoder` (verl's `mtp.detach_encoder`): no gradient flows from the MTP layers into the main model's hidden
    states or the token embeddings (only the MTP layers learn from the MTP loss). Under gradient checkpointing, MTP
    layer k is layer num_hidden_layers + k of `lathe.models.decoder.recomputes`: a count of recomputed layers that
    ends within the main stack leaves the MTP layers their activations (the last forward, freed first in backward).
    Megatron differs here: its MTP layers recompute under recompute_granularity=full whatever recompute_method says,
    so a count translated from its block method recomputes fewer layers than Megatron did."""
    inner = model.model
    cos, sin = inner.rotary_emb(position_ids, hidden.dtype)
    ids, out = input_ids, []
    for k, layer in enumerate(inner.mtp_layers):
        ids = roll_packed(ids, cu_seqlens)
        embeds = inner.embed_tokens(ids if local is None else local(ids))
        if detach_encoder:
            hidden, embeds = hidden.detach(), embeds.detach()
        if recomputes(inner, len(inner.layers) + k):      # numbered after the main stack's layers
            hidden = checkpoint(layer, hidden, embeds, cos, sin, attn, use_reentrant=False)
        else:
            hidden = layer(hidden, embeds, cos, sin, attn)
        out.append(hidden)
    return out


class MiMoMtpLayer(DecoderLayer):
    """A Qwen2 decoder layer (its parameters under the layer's own name, as MiMo's checkpoints hold them) between the
    two input norms plus the input projection and the final norm (module doc)."""

    def __init__(self, cfg: LatheConfig):
        super().__init__(cfg, 0)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(self, hidden, embeds, cos, sin, attn):
        z = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))
        return self.final_layernorm(super().forward(z, cos, sin, attn))


def mtp_layers(cfg: LatheConfig) -> nn.ModuleList:
    """The family's MTP layers (`cfg.num_mtp_layers` MiMo layers)."""
    return nn.ModuleList(MiMoMtpLayer(cfg) for _ in range(cfg.num_mtp_layers))


def has_mtp(model) -> bool:
    """Whether `model` (any module) carries MTP layers."""
    return len(getattr(getattr(model, "model", None), "mtp_layers", None) or ()) > 0
