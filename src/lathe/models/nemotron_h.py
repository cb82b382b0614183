"""Nemotron-H's Mamba2 token mixer (`backbone.layers.<i>.mixer` of a `mamba` / `linear_attention` layer), on packed
sequences: the first part of a native Nemotron-H (NVIDIA-Nemotron-3-Nano, verl's
`run_nemotron_nano_v3_30b_a3b_megatron.sh`), which still runs on the transformers fallback. Not yet built: the
decoder's other layer kinds (relu^2 MLP, the MoE with non-gated experts and latent projections, attention without
RoPE) and their config in `LatheConfig`, the checkpoint names, the engine's Mamba states, and fla's kernels on CUDA.

The mixer, as transformers' `NemotronHMamba2Mixer` computes it (its parameter names, so a state dict moves as it is):
in_proj splits into z (the gate, H P), xBC (H P + 2 G N) and dt (H); xBC goes through the depthwise causal
convolution (with bias) and SiLU and splits into x, B, C; dt = clamp(softplus(dt + dt_bias), time_step_limit),
A = -exp(A_log); the scan (`lathe.models.ssd`) with the D skip; then a gated RMSNorm over groups of channels
(x silu(z), normalised per group of H P / G, times its weight) and out_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lathe.models.linear_attention import causal_conv1d, conv_state
from lathe.models.ssd import chunk_scan


@dataclass
class Mamba2Config:
    """A Nemotron-H `config.json`'s Mamba keys (with the `mamba_*` spellings its Hub configs use). Its `chunk_size`
    is not read: the scan's chunk changes only its rounding (`lathe.models.ssd.chunk_scan` picks its own)."""

    hidden_size: int
    num_heads: int                          # mamba_num_heads
    head_dim: int                           # mamba_head_dim
    n_groups: int                           # n_groups / mamba_n_groups
    state_size: int                         # ssm_state_size
    conv_kernel: int = 4                    # conv_kernel / mamba_d_conv
    conv_bias: bool = True                  # use_conv_bias / mamba_conv_bias
    proj_bias: bool = False                 # use_bias
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    eps: float = 1e-5                       # layer_norm_epsilon

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Mamba2Config":
        def key(name: str, alias: str, default=None):
            return d[alias] if alias in d else d.get(name, default)
        heads, groups = int(d["mamba_num_heads"]), int(key("n_groups", "mamba_n_groups", 8))
        if heads % groups:
            raise ValueError(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}")
        limit = key("time_step_limit", "mamba_dt_limit", (0.0, float("inf")))
        return cls(hidden_size=int(d["hidden_size"]), num_heads=heads, head_dim=int(d["mamba_head_dim"]),
                   n_groups=groups, state_size=int(d["ssm_state_size"]), conv_kernel=int(key("conv_kernel",
                   "mamba_d_conv", 4)), conv_bias=bool(key("use_conv_bias", "mamba_conv_bias", True)),
                   proj_bias=bool(d.get("use_bias", False)), time_step_limit=(float(limit[0]), float(limit[1])),
                   eps=float(d.get("layer_norm_epsilon", 1e-5)))


class GroupedGatedRMSNorm(nn.Module):
    """weight * rms_norm(x silu(z)) over groups of `group` channels, computed in float32 and cast back before the
    weight (transformers' `NemotronHRMSNormGated`, gate before the norm)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float() * nn.functional.silu(z.float())
        g = h.unflatten(-1, (-1, self.group))
        h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(x.dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba2 mixer (module doc) over a packed stream."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.inner + cfg.conv_dim + cfg.num_heads, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                bias=cfg.conv_bias, padding=cfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_heads))
        self.D = nn.Parameter(torch.ones(cfg.num_heads))
        self.norm = GroupedGatedRMSNorm(cfg.inner, cfg.inner // cfg.n_groups, cfg.eps)
        self.out_proj = nn.Linear(cfg.inner, cfg.hidden_size, bias=cfg.proj_bias)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, state=None):
        """A packed stream x (T, hidden) of sequences delimited by `cu_seqlens`, each from a zero state; or, given
        `state` = (convolution inputs (S, conv_dim, K-1), scan states (S, H, P, N)), each continuing from its own,
        and then returns (output, the final states in the same form)."""
        cfg = self.cfg
        z, xbc, dt = self.in_proj(x).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        conv = None if state is None else conv_state(xbc, cu_seqlens, cfg.conv_kernel, state[0])
        xbc = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), cu_seqlens, None if state is None else state[0],
                            bias=self.conv1d.bias)
        xs, B, C = xbc.split([cfg.inner, cfg.n_groups * cfg.state_size, cfg.n_groups * cfg.state_size], dim=-1)
        y, final = chunk_scan(xs.unflatten(-1, (cfg.num_heads, cfg.head_dim)), self.step_sizes(dt),
                              -self.A_log.float().exp(), B.unflatten(-1, (cfg.n_groups, cfg.state_size)),
                              C.unflatten(-1, (cfg.n_groups, cfg.state_size)), cu_seqlens, max_seqlen, D=self.D,
                              initial_state=None if state is None else state[1])
        out = self.out_proj(self.norm(y.flatten(-2), z))
        return out if state is None else (out, (conv, final))

    def step_sizes(self, dt: torch.Tensor) -> torch.Tensor:
        """clamp(softplus(dt + dt_bias), time_step_limit) in float32."""
        low, high = self.cfg.time_step_limit
        return nn.functional.softplus(dt.float() + self.dt_bias.float()).clamp(min=low, max=high)
