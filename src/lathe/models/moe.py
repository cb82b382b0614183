"""Qwen3-MoE's sparse layers: a top-k router over SwiGLU experts, and the routers' load-balancing loss.

Parameter names and layouts are transformers 5's (`Qwen3MoeSparseMoeBlock`), so a state dict moves between the two
with no renaming:
- `mlp.gate.weight` (E, H): the router;
- `mlp.experts.gate_up_proj` (E, 2I, H): each expert's gate rows then up rows; `mlp.experts.down_proj` (E, H, I).
Checkpoints on disk (the Hub's, and what transformers' `save_pretrained` writes) name each expert's matrices
(`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`): `fuse_expert_weights` reads that layout into the fused
one and `split_expert_weights` writes it back.

Routing (as transformers): p = softmax(x G^T) in float32; each token takes its top-k experts with weights p_topk,
renormalised to sum to 1 when `norm_topk_prob`. The token-expert assignments are sorted by expert, so each expert's
tokens are one contiguous run of rows; the experts then run as
- one grouped matmul per projection (`torch._grouped_mm`) where the device has it: fixed shapes and no host sync, so
  a decode step of a MoE model can be captured in a CUDA graph (`grouped_mm_supported`);
- else a loop over the experts that received tokens (the CPU path and the reference), which reads the per-expert
  counts on the host.

Routing replay (verl's `router_replay`, R2/R3): a block's `routing` hook, when set, takes `route`'s place. The engine
records each token's choices through one (`lathe.engine.routing`); the trainer replays given choices or records its
own (`lathe.models.routing`). A replayed token's weights are the router's softmax probabilities of the given
experts, renormalised as the family does (verl's Megatron patch and slime gather the scores at the replayed
indices the same way); a token without given choices (-1: padding, or one the engine never fed) routes by its own top-k.

The load-balancing loss (Switch Transformer, Fedus et al. 2021, eqs. 4-6, as transformers' `load_balancing_loss_func`
computes it over all sparse layers together) is collected on request: `with collect_router_stats(model) as stats:`
around a forward, then `stats.aux_loss()`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lathe.models.config import LatheConfig, MoeConfig

# (Nemotron-H's: `mixer.experts`, non-gated: up_proj and down_proj alone, `lathe.models.nemotron_h`)
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.(?:mlp|mixer)\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


class TopKRouter(nn.Module):
    """`mlp.gate`: the router's (E, H) weight. Not an `nn.Linear`, as in transformers, so LoRA's `all-linear` (PEFT's
    matching) leaves it alone."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class Experts(nn.Module):
    """`mlp.experts`: every expert's SwiGLU weights, stacked (module doc)."""

    def __init__(self, cfg: MoeConfig, hidden: int):
        super().__init__()
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))

    def forward(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row of `rows` (N, H) through its expert, `experts` (N,) ascending (`run_experts`). A module call, so
        that a wrapper (FSDP2's gathers, `lathe.train.expert_parallel`'s dispatch) sees the experts run."""
        return run_experts(rows, experts, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    """A Qwen3-MoE layer's MLP: route each token to its top-k experts and sum their outputs, weighted."""

    router_stats: RouterStats | None = None     # set by `collect_router_stats` for its forwards
    # set for good by `collect_router_stats`: every later forward calls `_record` (an eager call, a graph break in a
    # compiled layer), recording or not, so that a layer recomputed in backward (gradient checkpointing) runs the
    # very graphs its forward ran and saves the same tensors
    records_routing: bool = False
    # routing replay's hook (module doc): (probs (T, E), top_k, norm_topk_prob) -> (weights, experts), or None; set
    # with `set_routing`, which also sets the flag a compiled layer checks (a bool: the hook object itself, which
    # changes per batch, is read only behind the graph break, so it costs no recompilation)
    routing = None
    hooks_routing: bool = False
    balance_losses: bool = True       # records its routing for the load-balancing losses (`collect_router_stats`)
    # the engine's path for the experts in its decode steps (`lathe.engine.triton_moe.fused_experts`), or None:
    # `experts_forward`'s arguments and result (plain SwiGLU, no biases; GPT-OSS's block adds its biases and its
    # activation's (alpha, limit)); set on the engine's own model only, and unset around its prefill steps (a
    # compiled layer keeps one variant with it and one without)
    decode_experts = None

    def __init__(self, cfg: LatheConfig):
        super().__init__()
        self.moe, self.moe_hidden = cfg.moe, cfg.hidden_size
        self.gate = TopKRouter(cfg.hidden_size, cfg.moe.num_experts)
        self.experts = Experts(cfg.moe, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = self.route(probs, self.moe.norm_topk_prob)
        if self.records_routing:
            self._record(probs, chosen, logits)
        if self.decode_experts is not None:
            return self.decode_experts(flat, weights.to(x.dtype), chosen, self.experts.gate_up_proj,
                                       self.experts.down_proj).view(*lead, h)
        return sorted_forward(flat, weights.to(x.dtype), chosen, self.experts).view(*lead, h)

    def route(self, probs: torch.Tensor, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` over this block's top-k, or its `routing` hook's choice (routing replay, module doc)."""
        if not self.hooks_routing:
            return route(probs, self.moe.num_experts_per_tok, norm_topk_prob)
        return self._hooked(probs, norm_topk_prob)

    def set_routing(self, hook) -> None:
        """Install routing replay's hook (None: route by the block's own top-k again)."""
        self.routing, self.hooks_routing = hook, hook is not None

    @torch.compiler.disable
    def _hooked(self, probs: torch.Tensor, norm_topk_prob: bool, **router) -> tuple[torch.Tensor, torch.Tensor]:
        """The hook's (weights, experts); `router` (`own`, `weigh`): a family whose router is not a top-k over
        `probs` (DeepSeek-V3's group-limited choice) says how it chooses and weighs (`replay_route`)."""
        return self.routing(probs, self.moe.num_experts_per_tok, norm_topk_prob, **router)

    @torch.compiler.disable
    def _record(self, probs: torch.Tensor, chosen: torch.Tensor, logits: torch.Tensor) -> None:
        if self.router_stats is not None:
            self.router_stats.record(probs, chosen, logits)


def route(probs: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, experts (T, k)) from the routing probabilities (T, E)."""
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def replay_route(probs: torch.Tensor, top_k: int, norm_topk_prob: bool, given: torch.Tensor, *, own=None,
                 weigh=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with the experts `given` (T, k) (any integer type; a row holding -1 takes its own choice): the
    weights are the probabilities of the given experts, renormalised when `norm_topk_prob`. A family with a router
    of its own passes `own(probs) -> (weights, experts)` (its choice) and `weigh(probs, experts) -> weights`."""
    mine = own(probs)[1] if own is not None else torch.topk(probs, top_k, dim=-1).indices
    given = given.to(device=probs.device, dtype=mine.dtype)
    chosen = torch.where((given < 0).any(-1, keepdim=True), mine, given)
    if weigh is not None:
        return weigh(probs, chosen), chosen
    weights = probs.gather(-1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def sparse_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE layers in order (routing replay's layer index)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def experts_forward(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                    act=None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t of x (T, H) (`sorted_forward` over
    `run_experts`). `gate_up` (E, 2I, H) and `down` (E, H, I) as `nn.Linear` weights (views of transposed tensors
    welcome); `biases`: the experts' (gate_up (E, 2I), down (E, H)) biases, or None; `act`: the activation from the
    gate_up output (T, 2I) to the down projection's input (default: SwiGLU, gate rows then up)."""
    return sorted_forward(x, weights, chosen, functools.partial(run_experts, gate_up=gate_up, down=down, act=act,
                                                                biases=biases))


def sorted_forward(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, run) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]): the (T, k) assignments sorted by expert (stable: in token
    order within an expert), `run(rows, experts)` over the sorted rows, the outputs put back in (token, j) order and
    summed over j."""
    top_k = chosen.shape[-1]
    whole = getattr(run, "token_major", None)     # (data-parallel attention's experts: `lathe.engine.expert_parallel`)
    if whole is not None:
        return (whole(x, chosen).view(*chosen.shape, -1) * weights.unsqueeze(-1)).sum(1)
    sorted_experts, order = chosen.reshape(-1).sort(stable=True)
    ys = run(x.index_select(0, order // top_k), sorted_experts)
    # back to (token, j) order, then each token's k outputs summed: no atomic adds, so the sum is deterministic
    ys = torch.empty_like(ys).index_copy_(0, order, ys).view(*chosen.shape, -1)
    return (ys * weights.unsqueeze(-1)).sum(1)


def run_experts(rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=None,
                biases=None) -> torch.Tensor:
    """Each row of `rows` (N, H) through its expert, `experts` (N,) ascending, so each expert's rows are one
    contiguous run (grouped matmul or loop, module doc); weights as `experts_forward`'s."""
    act = _swiglu if act is None else act
    ends = torch.searchsorted(experts, torch.arange(1, gate_up.shape[0] + 1, device=rows.device))
    if grouped_mm_supported(rows.device, rows.dtype, rows.shape[-1], down.shape[-1]):
        return _grouped(rows, ends.to(torch.int32), gate_up, down, act, biases, experts)
    return _looped(rows, ends, gate_up, down, act, biases)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _grouped(rows: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act,
             biases, experts: torch.Tensor) -> torch.Tensor:
    """The experts over their runs of `rows` with one grouped matmul per projection (`offsets`: each run's end;
    `experts`: each row's expert, for the biases)."""
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
    if biases is not None:              # (rows past the last offset may name no expert: data-parallel attention's)
        experts = experts.clamp(max=gate_up.shape[0] - 1)
        h = h + biases[0].index_select(0, experts)
    out = torch._grouped_mm(act(h), down.transpose(1, 2), offs=offsets)
    return out if biases is None else out + biases[1].index_select(0, experts)


@torch.compiler.disable     # (host-read counts: compiled, each pattern of idle experts would be another graph)
def _looped(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act,
            biases) -> torch.Tensor:
    """The experts over their runs of `rows`, one expert at a time (experts without tokens skipped)."""
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    outs = []
    for e, part in enumerate(rows.split(counts)):
        if counts[e] or not outs and e == len(counts) - 1:
            # (no rows at all: the last expert over the empty rows, so that the output still reaches the rows and the
            # weights: a rank of an expert-parallel group that received no rows runs the backward's collectives as
            # the others do, not a graph without them)
            b_gate_up, b_down = (None, None) if biases is None else (biases[0][e], biases[1][e])
            hidden = act(nn.functional.linear(part, gate_up[e], b_gate_up))
            outs.append(nn.functional.linear(hidden, down[e], b_down))
    return torch.cat(outs)


@torch.compiler.assume_constant_result     # compiled layers take the answer as it is, without tracing into it
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the experts run as grouped matmuls: torch's `_grouped_mm` in bfloat16 on an NVIDIA GPU of compute
    capability 9.0 or later (Hopper), with every row 16-byte aligned. Elsewhere the per-expert loop runs."""
    return _grouped_mm_supported(device, dtype, hidden, inter)


@functools.cache
def _grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    from lathe.device import nvidia_capability
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16 or hidden % 8 or inter % 8:
        return False
    capability = nvidia_capability(device)
    return capability is not None and capability >= (9, 0)


def graph_capturable(model: nn.Module) -> bool:
    """Whether `model`'s forward has no host sync in its MoE layers (none, or all on the grouped matmul), which a
    CUDA graph's capture needs."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return all(grouped_mm_supported(b.experts.down_proj.device, b.experts.down_proj.dtype, b.moe_hidden,
                                    b.moe.moe_intermediate_size) for b in blocks)


# ---- the load-balancing loss -------------------------------------------------------------------------------------


@dataclass
class RouterStats:
    """What the sparse layers of one forward routed: per layer, the top-k assignments per expert and the routing
    probabilities summed over the tokens."""

    num_experts: int
    top_k: int = 1
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)   # (E,) float32 counts, no gradient
    prob_per_expert: list[torch.Tensor] = field(default_factory=list)     # (E,) float32 sums, with gradient
    # each layer call's router logits (T, E) (with the index of the tokens that count, where `token_index` is set),
    # kept only for the z-loss (`keep_logits`): it is formed from them after the forward, so that a layer recomputed
    # in backward (gradient checkpointing) saves what its forward saved
    logits: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    layer_rows: list[int] = field(default_factory=list)        # the tokens each recorded layer call routed
    rows: int = 0
    # the tokens that count, by the length of the stream a sparse layer routes: {T: (n,) indices into its T rows},
    # or None (all count). The trainer sets it per micro-batch (`lathe.train.router_tokens`): a padded forward's
    # padding, a sequence-parallel slice's padding and ghost rows' tokens (`lathe.batch.GHOST`) are left out, so
    # the statistics are those of the real tokens alone, as if the rest were not there
    token_index: dict[int, torch.Tensor] | None = None
    keep_logits: bool = False

    def record(self, probs: torch.Tensor, chosen: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        # nothing recorded here may be saved for backward (a checkpointed layer's recomputation, which records
        # nothing, must save what its forward saved): the kept rows' sum is `_SumRows`'s, and the logits are kept
        # whole with their index, the z-loss selecting after the forward (`per_layer`)
        index = None
        if self.token_index is not None:
            index = self.token_index.get(probs.shape[0])
            if index is None:
                raise ValueError(f"router statistics: a sparse layer routed {probs.shape[0]} tokens, but the tokens "
                                 f"that count are known for streams of {sorted(self.token_index)} only (the "
                                 "micro-batch's padded and packed layouts); this forward's layout is not one of them")
        with torch.no_grad():
            chosen = chosen if index is None else chosen.index_select(0, index)
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device)
            counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
        self.tokens_per_expert.append(counts)
        self.prob_per_expert.append(probs.sum(0) if index is None else _SumRows.apply(probs, index))
        if self.keep_logits:
            self.logits.append(logits if index is None else (logits, index))
        self.layer_rows.append(chosen.shape[0])
        self.rows += chosen.shape[0]

    def per_layer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(assignments per expert (L, E), routing probabilities summed per expert (L, E), z sums (L,), tokens
        (L,)) of each recorded sparse-layer call in order, or None when none ran."""
        if not self.tokens_per_expert:
            return None
        probs = torch.stack(self.prob_per_expert)
        z = (torch.stack([torch.logsumexp(_kept(x).float(), dim=-1).square().sum() for x in self.logits])
             if self.keep_logits else probs.new_zeros(len(probs)))
        return (torch.stack(self.tokens_per_expert).to(probs.device), probs, z,
                torch.tensor(self.layer_rows, dtype=torch.float32, device=probs.device))

    def megatron_losses(self, layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's router losses, each summed over the sparse layers: the switch load-balancing loss
        E * sum_e f_e P_e with f_e the layer's share of top-k assignments to expert e (normalised by k: the f_e sum
        to 1) and P_e its mean routing probability, and the z-loss, the mean over tokens of logsumexp(router
        logits)^2 (0 unless recorded with `keep_logits`). `layers`: `per_layer()` summed over the ranks that share
        the tokens (None: this rank's). Zeros when no sparse layer ran."""
        layers = self.per_layer() if layers is None else layers
        if layers is None:
            return torch.zeros(()), torch.zeros(())
        counts, probs, z, rows = layers
        rows = rows.clamp(min=1)[:, None]
        aux = self.num_experts * (counts / (self.top_k * rows) * (probs / rows)).sum()
        return aux, (z / rows[:, 0]).sum()

    def totals(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(top-k assignments per expert (E,), routing probabilities summed per expert (E,), rows), over every
        recorded forward and sparse layer."""
        if not self.tokens_per_expert:
            return torch.zeros(self.num_experts), torch.zeros(self.num_experts), 0
        return torch.stack(self.tokens_per_expert).sum(0), torch.stack(self.prob_per_expert).sum(0), self.rows

    def aux_loss(self, totals: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """E * sum_e f_e P_e, with f_e the share of top-k assignments to expert e and P_e its mean routing
        probability, both over every token of every sparse layer (transformers' `load_balancing_loss_func`, whose
        f_e sums to k). `totals`: `totals()` summed over the ranks that share the tokens (None: this one's). Without
        a sparse layer run (no tokens), 0."""
        counts, probs, rows = self.totals() if totals is None else totals
        if not rows:
            return torch.zeros(())
        return self.num_experts * (counts / rows * (probs / rows)).sum()


class _SumRows(torch.autograd.Function):
    """The sum over dim 0 of the rows `index` of a (T, E) tensor, its backward the sum's gradient on those rows and 0
    elsewhere, with no tensor saved for backward (`RouterStats.record`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.index = x.shape[0], index          # an attribute, not a saved tensor (see above)
        return x.index_select(0, index).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_zeros(ctx.rows, grad.shape[0])
        out[ctx.index] = grad
        return out, None


def _kept(logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A recorded layer call's router logits of the tokens that count (`RouterStats.record`)."""
    return logits if isinstance(logits, torch.Tensor) else logits[0].index_select(0, logits[1])


def router_aux_loss_coef(model: nn.Module) -> float:
    """The weight a trainer gives `model`'s load-balancing loss: its config's `router_aux_loss_coef` where the config
    asks for the loss (`output_router_logits`, as transformers adds it to its loss) and the model has lathe's MoE
    layers; else 0."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    if moe is None or not moe.output_router_logits:
        return 0.0
    return moe.router_aux_loss_coef if any(isinstance(m, SparseMoeBlock) for m in model.modules()) else 0.0


def megatron_router_coefs(model: nn.Module, aux: float, z: float) -> tuple[float, float] | None:
    """(aux, z) coefficients of Megatron's router losses for `model` (the actor's `moe_aux_loss_coeff`,
    `moe_z_loss_coeff`), or None when both are 0. Raises for a model whose routing lathe does not record: a dense
    model (nothing to balance) or the DeepSeek-V3 family (sigmoid scores; not built)."""
    if not aux and not z:
        return None
    keys = "actor_rollout_ref.actor.moe_aux_loss_coeff / moe_z_loss_coeff (Megatron's override_transformer_config)"
    blocks = sparse_blocks(model)
    arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
    if not blocks:
        raise ValueError(f"{keys} = {aux} / {z}: {arch} has no mixture-of-experts layers, so there is no router "
                         "loss to add. Fix: remove these keys for a dense model.")
    if any(not b.balance_losses for b in blocks):
        raise ValueError(f"{keys} = {aux} / {z}: Megatron's router losses are not built for {arch}'s sparse layers "
                         "(its sigmoid router's scores). Fix: set both to 0.")
    return aux, z


@contextmanager
def collect_router_stats(model: nn.Module, keep_logits: bool = False) -> Iterator[RouterStats | None]:
    """Record the routing of the forwards run inside the block (`RouterStats`; `keep_logits`: the router logits
    too, for the z-loss); None for a model without sparse layers. Recomputed layers (gradient checkpointing, in
    backward) record nothing."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        yield None
        return
    stats = RouterStats(blocks[0].moe.num_experts, blocks[0].moe.num_experts_per_tok, keep_logits=keep_logits)
    for block in blocks:
        block.router_stats, block.records_routing = stats, True
    try:
        yield stats
    finally:
        for block in blocks:
            block.router_stats = None


# ---- checkpoint layouts ------------------------------------------------------------------------------------------


def fuse_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with per-expert names (`...mlp.experts.<e>.gate_proj.weight`, the Hub's layout) in the fused
    layout lathe's and transformers 5's modules hold; other names pass through. Experts must be numbered 0..E-1.
    Non-gated experts (Nemotron-H's `mixer.experts`: up_proj and down_proj alone) stack into `up_proj` and
    `down_proj`."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = EXPERT_NAME.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for prefix, projs in groups.items():
        counts = {p: sorted(ts) for p, ts in projs.items()}
        n = len(counts.get("down_proj", []))
        gated = _gated(prefix)
        wanted = {"gate_proj", "up_proj", "down_proj"} if gated else {"up_proj", "down_proj"}
        if set(projs) != wanted or any(c != list(range(n)) for c in counts.values()):
            found = {p: len(c) for p, c in counts.items()}
            raise ValueError(f"{prefix}: the checkpoint's experts are incomplete ({found} of "
                             f"{'/'.join(sorted(wanted))}, numbered from 0); re-export or re-download it")
        if gated:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        else:
            out[f"{prefix}.up_proj"] = torch.stack([projs["up_proj"][e] for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def _gated(prefix: str) -> bool:
    """Whether the experts under `prefix` are SwiGLU (gate and up projections) rather than Nemotron-H's non-gated
    ones (`mixer.experts`)."""
    return not prefix.endswith(".mixer.experts")


def fused_names(names) -> set[str]:
    """The module names of a checkpoint's tensor names: per-expert names become those of their fused tensors."""
    out = set()
    for name in names:
        m = EXPERT_NAME.match(name)
        if m is None:
            out.add(name)
        else:
            fused = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj" if _gated(m["prefix"]) else "up_proj"
            out.add(f"{m['prefix']}.{fused}")
    return out


def split_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused expert tensors of a state dict under per-expert names (what transformers' `save_pretrained` writes
    and every Qwen3-MoE reader loads); other names pass through."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[:-len(".gate_up_proj")]
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gates[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = ups[e].contiguous()
        elif name.endswith((".mlp.experts.down_proj", ".mixer.experts.down_proj", ".mixer.experts.up_proj")):
            prefix, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{proj}.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out
