"""Nemotron-H (`NemotronHForCausalLM`: NVIDIA-Nemotron-3-Nano, Nemotron-H; verl's
`run_nemotron_nano_v3_30b_a3b_*.sh`) in lathe's decoder, as transformers' `modeling_nemotron_h` computes it
(`LatheConfig.nemotron`, `lathe.models.nemotron_h_config`).

Each layer is `x + mixer(norm(x))`, its mixer one of four by the layer's block type: Mamba2, attention, a relu^2
MLP or a MoE. The norms keep their weight's multiply in float32 (`NemotronRMSNorm`).
- Mamba2 (`Mamba2Mixer`): in_proj splits into z (the gate, H P), xBC (H P + 2 G N) and dt (H); xBC goes through the
  depthwise causal convolution (with bias) and SiLU and splits into x, B, C; dt = clamp(softplus(dt + dt_bias),
  time_step_limit), A = -exp(A_log); the scan (`lathe.models.ssd`) with the D skip; then a gated RMSNorm over groups
  of channels (x silu(z), normalised per group of H P / G, times its weight) and out_proj.
- Attention (`NemotronAttention`): q, k, v, o projections without biases, grouped-query heads, no RoPE and no q/k norm:
  the layer order alone gives the model its positions.
- MLP (`NemotronMLP`): down_proj(relu(up_proj(x))^2).
- MoE (`NemotronMoeBlock`): DeepSeek-V3's group-limited sigmoid router with its selection bias
  (`lathe.models.deepseek`), routed experts that are non-gated relu^2 MLPs (`mixer.experts.up_proj` (E, I, Hl),
  `down_proj` (E, Hl, I); per expert on disk), run on the optional latent projections' width Hl (fc1_latent_proj
  before, fc2_latent_proj after), plus a shared relu^2 expert (`shared_experts`) on the layer's input.

Names are transformers' module names, `model.layers.<i>.norm` / `.mixer.*`, with lathe's `model.embed_tokens` and
`model.norm` for transformers' `model.embeddings` and `model.norm_f`; checkpoints hold `backbone.*` and one tensor
per expert (`lathe.models.io.HUB_NAMES`, `lathe.models.moe.fuse_expert_weights`).

The Mamba2 layers see each packed sequence from a zero state. A padded batch runs them on its rows' real tokens packed
(transformers zeroes the padding instead, the same for left or right padding). An attention callable that carries
`linear_states` (the engine's step, `lathe.engine.linear_state`) has each sequence continue from its own states; a
step of one token per sequence hands them to `Mamba2Mixer.step`. Prefix grouping (`actor.use_prefix_grouper`) runs
each prompt once and each response from its prompt's final states (`Mamba2Mixer.grouped`); Ulysses sequence
parallelism splits the Mamba2 layers by groups with their heads (`Mamba2Mixer.head_parallel`); tensor parallelism
(training: `lathe.train.tensor_parallel`; the engine: `lathe.engine.tensor_parallel`) cuts them by groups too, a
rank's convolution and per-head vectors read through `conv_params` / `head_params`. The scan runs on fla's kernels on
CUDA where installed (`lathe.models.ssd`), the convolution on fla's packed one (`linear_attention.causal_conv1d`).
"""

from __future__ import annotations

import torch
from torch import nn

from lathe.models.attention import GroupedAttention, PackedAttention, PaddedAttention
from lathe.models.config import LatheConfig
from lathe.models.decoder import RMSNorm, attend
from lathe.models.deepseek import DeepseekMoeBlock, DeepseekRouter
from lathe.models.linear_attention import causal_conv1d, conv_state, stepped
from lathe.models.moe import run_experts, sorted_forward
from lathe.models.nemotron_h_config import Mamba2Config
from lathe.models.ssd import chunk_scan

__all__ = ["Mamba2Config", "Mamba2Mixer", "NemotronBlock", "nemotron_parts"]


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
        and then returns (output, the final states in the same form); (None, None): each from a zero state, returning
        the final states as well (the engine's step of fresh sequences)."""
        cfg = self.cfg
        z, xbc, dt = self.in_proj(x).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        conv = None if state is None else conv_state(xbc, cu_seqlens, cfg.conv_kernel, state[0])
        xbc = self._conv(xbc, cu_seqlens, None if state is None else state[0])
        y, final = self._scan(xbc, self.step_sizes(dt), cu_seqlens, max_seqlen,
                              None if state is None else state[1])
        out = self.out_proj(self.norm(y.flatten(-2), z))
        return out if state is None else (out, (conv, final))

    def grouped(self, x: torch.Tensor, lin) -> torch.Tensor:
        """The prefix-grouped stream x (T, hidden) (`lathe.train.prefix_group`, its `GroupedLinear` layout `lin`):
        the prompts from a zero state, then each response from its prompt's final scan state, its convolution behind
        a copy of the prompt's last K-1 inputs (whose outputs are dropped), as `GatedDeltaNet.grouped` runs them. Each
        response token gets the inputs and state it has in its own row."""
        cfg = self.cfg
        z, xbc, dt = self.in_proj(x).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        dt, tp = self.step_sizes(dt), lin.prompt_tokens       # the prompts lead the stream, the responses follow
        if tp == x.shape[0]:                                  # no response token in the micro-batch
            y, _ = self._scan(self._conv(xbc, lin.cu_prompt), dt, lin.cu_prompt, lin.max_prompt)
            return self.out_proj(self.norm(y.flatten(-2), z))
        conv = self._conv(torch.cat([xbc[:tp], xbc.index_select(0, lin.extended)]), lin.cu_conv)
        y_prompt, final = self._scan(conv[:tp], dt[:tp], lin.cu_prompt, lin.max_prompt)
        y_response, _ = self._scan(conv[tp:].index_select(0, lin.kept), dt[tp:], lin.cu_response, lin.max_response,
                                   final.index_select(0, lin.group))
        return self.out_proj(self.norm(torch.cat([y_prompt, y_response]).flatten(-2), z))

    def head_parallel(self, x: torch.Tensor, split) -> torch.Tensor:
        """Ulysses: this rank's slice x (T/S, hidden) of a packed stream whose every sequence starts from a zero
        state. `split` (`lathe.train.ulysses.UlyssesAttention`) exchanges (T/S tokens, G groups, ...) for (T tokens,
        G/S groups, ...) and back (`to_heads`, `to_tokens`); its `inner` holds the whole padded stream's bounds. Each
        group's B and C travel with its heads' x and dt (one all-to-all), so rank s runs the convolution and the scan
        over every token for groups [s G/S, (s+1) G/S) and their heads, with those channels' convolution weights and
        bias and those heads' dt_bias, A_log and D. The outputs return to the token slice, where the gated norm (per
        token and group) meets z, which never leaves the rank."""
        cfg, n, size, rank = self.cfg, x.shape[0], split.sp.size, split.sp.rank
        g, per, p, s = cfg.n_groups, cfg.num_heads // cfg.n_groups, cfg.head_dim, cfg.state_size
        z, xbc, dt = self.in_proj(x).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        xs, B, C = xbc.split([cfg.inner, g * s, g * s], dim=-1)
        grouped = torch.cat([xs.view(n, g, per * p), B.view(n, g, s), C.view(n, g, s), dt.view(n, g, per)], dim=-1)
        xs, B, C, dt = split.to_heads(grouped).split([per * p, s, s, per], dim=-1)        # (T, G/S, ...)
        mine = g // size
        heads, groups = slice(rank * mine * per, (rank + 1) * mine * per), slice(rank * mine * s, (rank + 1) * mine * s)

        def channels(t: torch.Tensor) -> torch.Tensor:          # the rank's x, B and C channels of a conv tensor
            return torch.cat([t[heads.start * p:heads.stop * p], t[cfg.inner:][groups], t[cfg.inner + g * s:][groups]])
        weight, bias = self.conv_params()
        cu, longest = split.inner.cu_seqlens, split.inner.max_seqlen
        mixed = causal_conv1d(torch.cat([xs.flatten(-2), B.flatten(-2), C.flatten(-2)], dim=-1), channels(weight), cu,
                              bias=None if bias is None else channels(bias))
        xs, B, C = mixed.split([mine * per * p, mine * s, mine * s], dim=-1)
        _, a_log, d = self.head_params()
        y, _ = chunk_scan(xs.unflatten(-1, (mine * per, p)), self.step_sizes(dt.flatten(-2), heads),
                          -a_log[heads].float().exp(), B.unflatten(-1, (mine, s)), C.unflatten(-1, (mine, s)),
                          cu, longest, D=d[heads])
        return self.out_proj(self.norm(split.to_tokens(y).flatten(-2), z))

    def _conv(self, xbc: torch.Tensor, cu_seqlens: torch.Tensor, initial: torch.Tensor | None = None):
        """silu(the depthwise causal convolution, with its bias) of xBC over the packed sequences."""
        weight, bias = self.conv_params()
        return causal_conv1d(xbc, weight, cu_seqlens, initial, bias=bias)

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
              initial_state: torch.Tensor | None = None):
        """(y (T, H, P), final states (S, H, P, N)) of the convolved xBC's scan with steps dt."""
        cfg, (_, a_log, d) = self.cfg, self.head_params()
        xs, B, C = xbc.split([cfg.inner, cfg.n_groups * cfg.state_size, cfg.n_groups * cfg.state_size], dim=-1)
        return chunk_scan(xs.unflatten(-1, (cfg.num_heads, cfg.head_dim)), dt, -a_log.float().exp(),
                          B.unflatten(-1, (cfg.n_groups, cfg.state_size)),
                          C.unflatten(-1, (cfg.n_groups, cfg.state_size)), cu_seqlens, max_seqlen, D=d,
                          initial_state=initial_state)

    def conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The depthwise convolution's (weight (C, K), bias (C,) or None) over the [x | B | C] channels it runs (a
        tensor-parallel rank's: `lathe.train.tensor_parallel`)."""
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    def head_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dt_bias, A_log, D) of the heads it runs (a tensor-parallel rank's: `lathe.train.tensor_parallel`)."""
        return self.dt_bias, self.A_log, self.D

    def step(self, x: torch.Tensor, states) -> torch.Tensor:
        """One new token per sequence, x (S, hidden), each continuing from its own states, which `states` (the
        engine's `LinearStep`) advances where they lie (`conv_step`, `scan_step`). No host sync."""
        cfg, (_, a_log, d) = self.cfg, self.head_params()
        z, xbc, dt = self.in_proj(x).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        xbc = states.conv_step(xbc, *self.conv_params())
        xs, B, C = xbc.split([cfg.inner, cfg.n_groups * cfg.state_size, cfg.n_groups * cfg.state_size], dim=-1)
        y = states.scan_step(xs.unflatten(-1, (cfg.num_heads, cfg.head_dim)), self.step_sizes(dt),
                             -a_log.float().exp(), B.unflatten(-1, (cfg.n_groups, cfg.state_size)),
                             C.unflatten(-1, (cfg.n_groups, cfg.state_size)), d)
        return self.out_proj(self.norm(y.flatten(-2), z))

    def step_sizes(self, dt: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """clamp(softplus(dt + dt_bias), time_step_limit) in float32 (dt of the `heads` only: a rank's under
        Ulysses)."""
        low, high = self.cfg.time_step_limit
        return nn.functional.softplus(dt.float() + self.head_params()[0][heads].float()).clamp(min=low, max=high)


class NemotronRMSNorm(RMSNorm):
    """weight * x / rms(x) with the weight's multiply in float32, cast back after it (transformers'
    `NemotronHRMSNorm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self.normalized(x)).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class NemotronMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): the `mlp` layers' mixer and the MoE's shared expert."""

    def __init__(self, hidden: int, width: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronAttention(nn.Module):
    """Grouped-query attention without RoPE, q/k norms or biases."""

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        if attn.rotates:
            raise NotImplementedError("Nemotron-H's attention has no RoPE; an attention that rotates q and k itself "
                                      "(the engine's decode step) must be built with rotates=False for it")
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        return self.o_proj(attend(attn, q, k, v, torch.compiler.is_compiling()))


class NemotronExperts(nn.Module):
    """`mixer.experts`: every routed expert's up_proj (E, I, Hl) and down_proj (E, Hl, I), stacked."""

    def __init__(self, num_experts: int, width: int, inter: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, inter, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, inter))

    def forward(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row of `rows` (N, Hl) through its expert, `experts` (N,) ascending (`run_experts`)."""
        return run_experts(rows, experts, self.up_proj, self.down_proj, act=relu2)


class NemotronMoeBlock(DeepseekMoeBlock):
    """The `moe` layers' mixer (module doc). Routing replay and the router's choice are DeepSeek-V3's
    (`DeepseekMoeBlock.choose`, `weigh`); no load-balancing loss (transformers' has none)."""

    def __init__(self, cfg: LatheConfig):
        nn.Module.__init__(self)
        n, h = cfg.nemotron, cfg.hidden_size
        self.moe, self.latent = cfg.moe, n.moe_latent_size
        self.moe_hidden = self.latent or h
        self.gate = DeepseekRouter(h, cfg.moe.num_experts)
        self.experts = NemotronExperts(cfg.moe.num_experts, self.moe_hidden, cfg.moe.moe_intermediate_size)
        self.shared_experts = NemotronMLP(h, n.shared_expert_intermediate_size, cfg.mlp_bias)
        if self.latent:
            self.fc1_latent_proj = nn.Linear(h, self.latent, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(self.latent, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        weights, chosen = self.routed(flat)
        rows = self.fc1_latent_proj(flat) if self.latent else flat
        if self.decode_experts is not None:     # the engine's decode steps (`SparseMoeBlock.decode_experts`)
            out = self.decode_experts(rows, weights.to(x.dtype), chosen, self.experts.up_proj, self.experts.down_proj,
                                      relu2=True)
        else:
            out = sorted_forward(rows, weights.to(x.dtype), chosen, self.experts)
        if self.latent:
            out = self.fc2_latent_proj(out)
        return out.view(*lead, h) + self.shared_experts(x)


class NoRope(nn.Module):
    """The decoder's `rotary_emb` for a model without RoPE: empty (..., 0) cos and sin, which no layer reads."""

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.zeros(*position_ids.shape, 0, dtype=dtype, device=position_ids.device)
        return empty, empty


class NemotronBlock(nn.Module):
    """One decoder layer: x + mixer(norm(x)), the mixer by the layer's block type (`index`: its place)."""

    def __init__(self, cfg: LatheConfig, index: int):
        super().__init__()
        self.block_type = cfg.nemotron.block_types[index]
        self.norm = NemotronRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.block_type == "linear_attention":
            self.mixer = Mamba2Mixer(cfg.nemotron.mamba)
        elif self.block_type == "full_attention":
            self.mixer = NemotronAttention(cfg)
        elif self.block_type == "moe":
            self.mixer = NemotronMoeBlock(cfg)
        else:
            self.mixer = NemotronMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        h = self.norm(x)
        if self.block_type == "linear_attention":
            return x + self._mamba(h, attn)
        return x + (self.mixer(h, attn) if self.block_type == "full_attention" else self.mixer(h))

    def _mamba(self, h: torch.Tensor, attn) -> torch.Tensor:
        out = stepped(self.mixer, h, attn)              # the engine's steps
        if out is not None:
            return out
        if isinstance(attn, PackedAttention):
            return self.mixer(h, attn.cu_seqlens, attn.max_seqlen)
        if isinstance(attn, PaddedAttention):
            return _rows_packed(self.mixer, h, attn)
        if isinstance(attn, GroupedAttention) and attn.linear is not None:      # actor.use_prefix_grouper
            return self.mixer.grouped(h, attn.linear)
        if hasattr(attn, "to_heads") and isinstance(attn.inner, PackedAttention):    # Ulysses
            return self.mixer.head_parallel(h, attn)
        what = ("a GroupedAttention without its GroupedLinear layout" if isinstance(attn, GroupedAttention)
                else "Ulysses sequence parallelism" if hasattr(attn, "to_heads") else type(attn).__name__)
        raise NotImplementedError(f"lathe's Nemotron-H Mamba2 layers run packed or padded batches and the engine's "
                                  f"steps; {what} is not built for them yet")


def _rows_packed(mixer: Mamba2Mixer, h: torch.Tensor, attn: PaddedAttention) -> torch.Tensor:
    """The mixer over each row of a padded batch h (B, L, hidden): every row from a zero state; with a mask, over the
    row's real tokens alone, packed (module doc), the padding's outputs zero."""
    b, length = h.shape[:2]
    mask = attn.attention_mask
    if mask is None:
        return mixer(h.reshape(b * length, -1), attn.row_bounds(b, length, h.device), length).view_as(h)
    real = mask.reshape(-1).nonzero().squeeze(1)
    lengths = mask.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    out = mixer(h.reshape(b * length, -1).index_select(0, real), cu, int(lengths.max()))
    return out.new_zeros(b * length, out.shape[-1]).index_copy(0, real, out).view(b, length, -1)


def nemotron_parts(cfg: LatheConfig) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(layers, final norm, `NoRope`) of a Nemotron-H `LatheDecoderModel`."""
    layers = nn.ModuleList(NemotronBlock(cfg, i) for i in range(cfg.num_hidden_layers))
    return layers, NemotronRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), NoRope()


def init_nemotron_weights(model: nn.Module, std: float = 0.02) -> None:
    """The initialisation of the Nemotron-H-only parameters (`lathe.models.decoder.init_weights` does the rest):
    A_log = log(1 .. H), D and the norms at 1, dt_bias at 1, the router and the routed experts normal(0, std), the
    selection bias 0."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                m.A_log.copy_(torch.arange(1, m.A_log.numel() + 1, dtype=torch.float32).log())
                m.D.fill_(1.0)
                m.dt_bias.fill_(1.0)
                m.norm.weight.fill_(1.0)
                if m.conv1d.bias is not None:
                    m.conv1d.bias.zero_()
            elif isinstance(m, NemotronExperts):
                m.up_proj.normal_(0.0, std)
                m.down_proj.normal_(0.0, std)
            elif isinstance(m, DeepseekRouter):
                m.weight.normal_(0.0, std)
                m.e_score_correction_bias.zero_()
