"""GPT-OSS's mixture-of-experts layer (`GptOssForCausalLM`), beside Qwen3-MoE's (`lathe.models.moe`), whose routing,
sorted expert runs (grouped matmul or loop) and load-balancing statistics it shares.

What differs from Qwen3-MoE (transformers' `modeling_gpt_oss` for the semantics):
- the router `mlp.router` has a bias: logits = x W^T + b; each token takes its top-k logits and a softmax over just
  those (the same weights as the full softmax's top-k renormalised, which is how `route` computes them);
- the experts `mlp.experts` have biases and store their matrices input-major, as the checkpoints do:
  `gate_up_proj` (E, H, 2I) with gate and up *interleaved* (gate in the even columns, up in the odd ones),
  `gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H), `down_proj_bias` (E, H). On disk too: no per-expert split;
- the activation is the clamped SwiGLU: gate <- min(gate, limit), up <- clamp(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate).

The attention side of GPT-OSS (a learned sink logit per head, sliding-window layers) is `Attention`'s
(`lathe.models.decoder`) with the attention callables of `lathe.models.attention`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lathe.models.config import LatheConfig
from lathe.models.moe import SparseMoeBlock, run_experts, sorted_forward


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of the interleaved gate/up output (..., 2I) -> (..., I) (module doc)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """`mlp.router`: weight (E, H) and bias (E,). Not an `nn.Linear`, so LoRA's `all-linear` leaves it alone."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class GptOssExperts(nn.Module):
    """`mlp.experts`: every expert's weights and biases in the checkpoint's input-major layout (module doc)."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        e, i, h = cfg.moe.num_experts, cfg.moe.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit
        self.act = functools.partial(clamped_swiglu, alpha=self.alpha, limit=self.limit)

    def forward(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row of `rows` (N, H) through its expert, `experts` (N,) ascending (as `Experts.forward`)."""
        return run_experts(rows, experts, *self.linear(), self.act, self.biases())

    def linear(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2I, H), down (E, H, I)): the matrices as `experts_forward` takes them (`nn.Linear` weights;
        transposed views, no copy)."""
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up bias (E, 2I), down bias (E, H)): `experts_forward`'s `biases`."""
        return self.gate_up_proj_bias, self.down_proj_bias


class GptOssMoeBlock(SparseMoeBlock):
    """A GPT-OSS layer's MLP: route each token to its top-k experts and sum their outputs, weighted. Records its
    routing for the load-balancing loss like `SparseMoeBlock` (probabilities: the softmax of all router logits)."""

    def __init__(self, cfg: LatheConfig):
        nn.Module.__init__(self)
        self.moe, self.moe_hidden = cfg.moe, cfg.hidden_size
        self.router = GptOssRouter(cfg.hidden_size, cfg.moe.num_experts)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        logits = self.router(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = self.route(probs, True)
        if self.records_routing:
            self._record(probs, chosen, logits)
        if self.decode_experts is not None:     # the engine's decode steps (`SparseMoeBlock.decode_experts`)
            return self.decode_experts(flat, weights.to(x.dtype), chosen, *self.experts.linear(),
                                       self.experts.biases(), (self.experts.alpha, self.experts.limit)).view(*lead, h)
        return sorted_forward(flat, weights.to(x.dtype), chosen, self.experts).view(*lead, h)

    def init_weights(self, std: float) -> None:
        """Random weights as transformers initialises them: normal matrices and router bias, zero expert biases."""
        for p in (self.router.weight, self.router.bias, self.experts.gate_up_proj, self.experts.down_proj):
            nn.init.normal_(p, mean=0.0, std=std)
        nn.init.zeros_(self.experts.gate_up_proj_bias)
        nn.init.zeros_(self.experts.down_proj_bias)
