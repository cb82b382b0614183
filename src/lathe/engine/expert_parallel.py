"""Expert-parallel MoE layers in a tensor-parallel engine replica (`rollout.expert_parallel_size` equal to
`rollout.tensor_model_parallel_size`, as vLLM's `enable_expert_parallel` runs a replica).

Each of the replica's T ranks holds `num_experts / T` whole experts of every sparse layer, rank r experts
[r E/T, (r+1) E/T) (the block training's expert parallelism gives rank r, `lathe.train.expert_parallel`); the router
is whole on every rank.

Why no all-to-all: attention is tensor-parallel (`lathe.engine.tensor_parallel`), so after o_proj's all-reduce
every rank of the replica holds the same whole hidden states of every token. Each rank therefore routes every token
itself with the whole router (the same choice everywhere, which is also what routing replay records), runs the
(token, choice) rows whose expert it holds through those experts, leaves the other rows at zero, and weights and
sums each token's k outputs as one process does (`lathe.models.moe.sorted_forward`): a partial sum of the layer's
output. One all-reduce over the replica adds the partials, the same collective a row-parallel down_proj costs a
dense layer.

Data-parallel attention (vLLM/SGLang's; verl's `rollout.data_parallel_size` D with `expert_parallel_size` D x T):
one engine of D replicas of T ranks, each replica with sequences of its own (`lathe.engine.data_parallel`), the
experts placed over all D x T ranks (engine rank d T + t holds the (d T + t)-th share). Each rank then holds other
tokens than the ranks of the other replicas, so `LocalExperts` gathers the tokens of the D ranks at its position t
(all-gathers of their counts, then of each token once with its k choices, padded to the most tokens), runs the
(token, choice) rows of its own experts, and a reduce-scatter hands each rank the outputs of its own rows, one per
(token, choice), from the experts at position t of every replica. Each token's k outputs are then weighted and summed
on its own replica in the block's order (`lathe.models.moe.sorted_forward`), so a TP=1 engine's sums are one
process's bit for bit (summing them on the experts' owners would return k times fewer bytes). A prefill step's rows
go in pieces of at most `GATHER_BYTES`. The block's all-reduce over the replica then adds the other positions' (and
the shared experts' partials), as without data parallelism. Eager only: the counts are read on the host.

Shared experts (Qwen3.5-MoE, Qwen3-Next: `SharedExpertMoeBlock`, gated by the whole `shared_expert_gate`;
DeepSeek-V3: `DeepseekMoeBlock`; Nemotron-H: `NemotronMoeBlock`) are cut like a dense MLP (columns of gate/up, rows
of down: `lathe.engine.tensor_parallel`) and their partial is added before the same all-reduce: a whole copy on every
rank would be counted T times by that sum, and the cut splits its weights and work T ways for no extra collective.
Nemotron-H's latent projections are whole: every rank projects each token down itself, its experts' partial sum is
projected back up (a linear map without bias, so the all-reduce after it sums the same thing). `ExpertSlice.place`
refuses any other block type.

The local experts run with the model's own code (`Experts.forward` / `GptOssExperts.forward`: grouped matmul or
loop) over rows sorted by expert, as in one process; `LocalExperts.forward` picks the rows:
- eagerly it takes the contiguous run of rows whose expert is local (two bounds read on the host: one sync per
  layer, which the expert loop makes anyway and an eager prefill step affords) and runs only those, so each rank
  computes 1/T of the expert work;
- inside a CUDA graph's capture (decode steps, only where the experts run as grouped matmuls: `graph_capturable`)
  nothing may be read on the host, so every row runs, the rows of other ranks' experts clamped onto the first or
  last local expert, and their outputs are masked to zero: the same result, at the price of running the other
  ranks' rows too (a decode step's rows are few; a grouped matmul that skipped rows past its last offset would
  save it).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch
from torch import nn

from lathe.device import capturing
from lathe.models.moe import EXPERT_NAME, SparseMoeBlock, sparse_blocks

TensorParallel = Any      # lathe.engine.tensor_parallel's (which imports this module)

# the stacked experts' tensors (Qwen3-MoE: gate_up_proj, down_proj; GPT-OSS also their biases), expert dim first
# (Nemotron-H's non-gated ones: mixer.experts.up_proj, down_proj)
FUSED = re.compile(r"^model\.(?:language_model\.)?layers\.\d+\.(?:mlp\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?"
                   r"|mixer\.experts\.(?:up_proj|down_proj))$")
KEY = "rollout.expert_parallel_size"
GATHER_BYTES = 256 << 20     # data-parallel attention: the most one piece of gathered rows takes (`_across_replicas`)
# set while a decode graph is warmed up and captured (`lathe.engine.cuda_graph.DecodeGraphs`): data-parallel
# attention's experts take the graph's path then (`_across_replicas_static`), its warm-up included, so that the path's
# first run (and any compilation of it) is not inside the capture
STATIC_ROWS = False
log = logging.getLogger("lathe")


def check_sizes(cfg, tp_size: int, ep_size: int, dp_size: int = 1) -> None:
    """Raise unless the experts of `cfg`'s model can be placed over a replica of `tp_size` ranks with `ep_size`
    (module doc): a MoE model needs ep_size == tp_size (or 1, which places them the same way, with a notice: lathe
    has no tensor-parallel experts) and whole experts per rank; a dense model ep_size == 1. With data-parallel
    attention over `dp_size` replicas (`lathe.engine.data_parallel`) a MoE model's ep_size is dp_size x tp_size."""
    tp_key = f"rollout.tensor_model_parallel_size={tp_size}"
    if cfg.moe is None:
        if ep_size != 1 or dp_size != 1:
            raise ValueError(f"{KEY}={ep_size}: {cfg.architecture} has no mixture-of-experts layers, so there are no "
                             f"experts to place (and no data-parallel attention to run). Fix: set {KEY}=1")
        return
    ranks = tp_size * dp_size
    if dp_size > 1 and ep_size != ranks:
        raise ValueError(f"{tp_key} with rollout.data_parallel_size={dp_size} (data-parallel attention): the experts "
                         f"are placed over the engine's {ranks} ranks, and {KEY}={ep_size}. Fix: set {KEY}={ranks}")
    if ep_size not in (1, tp_size, ranks):
        raise ValueError(f"{tp_key} with {KEY}={ep_size}: {cfg.architecture} is a mixture-of-experts model, whose "
                         f"experts lathe places whole over the replica's ranks (expert parallelism). Fix: set "
                         f"{KEY}={tp_size} (or 1, which runs the same way)")
    if ep_size == 1 and tp_size > 1:
        _notice_tensor_parallel_experts(cfg.architecture, tp_size)
    n = cfg.moe.num_experts
    if n % ranks:
        raise ValueError(f"{tp_key}{f' x rollout.data_parallel_size={dp_size}' if dp_size > 1 else ''}: each rank "
                         f"holds num_experts / {ranks} whole experts, and {cfg.architecture} has {n} experts. Fix: "
                         f"choose sizes whose product divides {n}")


@functools.cache
def _notice_tensor_parallel_experts(arch: str, tp_size: int) -> None:
    log.info("engine: %s's experts run expert-parallel over each replica's %d ranks (%s=1 asks for tensor-parallel "
             "experts, vLLM's default, which lathe does not cut: each rank holds whole experts instead; the same "
             "computation, another layout)", arch, tp_size, KEY)


class ExpertSlice:
    """The experts [first, first + count) that rank `rank` of a replica of `size` holds, and their tensors' slices."""

    def __init__(self, num_experts: int, rank: int, size: int):
        self.count = num_experts // size
        self.first = rank * self.count

    def local(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[(name, this rank's slice)] of an experts tensor (fused: the expert dim cut; per-expert checkpoint
        names: kept under their local number when local, else dropped); None for any other tensor."""
        if FUSED.match(name):
            return [(name, tensor.narrow(0, self.first, self.count))]
        m = EXPERT_NAME.match(name)
        if m is None:
            return None
        e = int(m["e"]) - self.first
        return [(f"{m['prefix']}.{e}.{m['proj']}.weight", tensor)] if 0 <= e < self.count else []

    def place(self, model: nn.Module, tp: TensorParallel, dp=None) -> None:
        """Make the sparse layers of `model` (on the meta device, before its weights are loaded) expert-parallel:
        each experts module holds `count` experts and runs only theirs, each block all-reduces its output. `dp`: the
        rank's `data_parallel.AttentionDataParallel` group (its replica's other ranks at its position) when the
        engine runs data-parallel attention, whose rows the experts gather (module doc)."""
        from lathe.models.deepseek import DeepseekMoeBlock
        from lathe.models.gpt_oss import GptOssMoeBlock
        from lathe.models.nemotron_h import NemotronMoeBlock
        from lathe.models.qwen3_5 import SharedExpertMoeBlock     # (shared experts cut as a dense MLP's columns)
        blocks = sparse_blocks(model)
        known = (SparseMoeBlock, GptOssMoeBlock, SharedExpertMoeBlock, DeepseekMoeBlock, NemotronMoeBlock)
        odd = sorted({type(b).__name__ for b in blocks if type(b) not in known})
        if odd:
            raise NotImplementedError(f"rollout.tensor_model_parallel_size={tp.size}: the MoE layers {odd} of "
                                      f"{model.config.architecture} are not placed over tensor-parallel engine "
                                      "replicas yet. Fix: set it to 1")
        for block in blocks:
            experts = block.experts
            for name, p in list(experts.named_parameters(recurse=False)):
                experts.register_parameter(name, nn.Parameter(p.new_empty((self.count,) + p.shape[1:]),
                                                              requires_grad=False))
            experts.__class__ = _subclass(LocalExperts, type(experts))
            experts.first, experts.count = self.first, self.count
            experts.dp = dp if dp is not None and dp.size > 1 else None
            block.__class__ = _subclass(ExpertParallelBlock, type(block))
            block.tp = tp


class ExpertParallelBlock:
    """A sparse block whose experts hold this rank's share (`LocalExperts`): its output summed over the replica."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class LocalExperts:
    """An experts module holding experts [first, first + count): the rows of other experts come out zero."""

    first: int
    count: int
    dp = None                        # data-parallel attention's group (module doc), or None

    @property
    def token_major(self):
        """Data-parallel attention: (tokens (T, H), their experts (T, k)) -> each (token, choice)'s output (T k, H),
        which `lathe.models.moe.sorted_forward` calls instead of `forward` where it is not None."""
        return self._across_replicas if self.dp is not None else None

    @torch.compiler.disable          # host-read bounds in eager runs (module doc)
    def forward(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        local = experts - self.first
        if capturing(rows.device):
            mine = (local >= 0) & (local < self.count)
            out = super().forward(rows, local.clamp(0, self.count - 1))
            return torch.where(mine.unsqueeze(-1), out, out.new_zeros(()))
        bounds = torch.tensor([self.first, self.first + self.count], device=experts.device, dtype=experts.dtype)
        start, end = torch.searchsorted(experts, bounds).tolist()
        out = rows.new_zeros(rows.shape)                  # an expert's output has the input's width
        if end > start:
            out[start:end] = super().forward(rows[start:end], local[start:end])
        return out


    @torch.compiler.disable          # host reads (counts), collectives: eager inside a compiled decoder
    def _across_replicas(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention (module doc; `lathe.models.moe.sorted_forward` hands the block's tokens here): the
        tokens `x` (T, H) and their experts `chosen` (T, k) of the replicas' ranks at this position gathered, the
        (token, choice) rows of this rank's experts run, and each rank's own rows' outputs, (T k, H) in (token,
        choice) order, handed back by a reduce-scatter; in pieces whose k-fold rows take at most `GATHER_BYTES`."""
        if STATIC_ROWS or capturing(x.device):
            return self._across_replicas_static(x, chosen)
        (n, width), k = x.shape, chosen.shape[1]
        most = max(self.dp.counts(n))                   # (every rank sees the same counts: the same pieces)
        piece = max(1, GATHER_BYTES // (self.dp.size * k * width * x.element_size()))
        out = x.new_empty(n * k, width)
        for start in range(0, most, piece):
            size = min(piece, most - start)
            own = x[start:start + size]
            pad = size - own.shape[0]
            tokens = self.dp.gather(nn.functional.pad(own, (0, 0, 0, pad)))                       # (D size, H)
            local = self.dp.gather(nn.functional.pad(chosen[start:start + size], (0, 0, 0, pad), value=-1))
            local = local.reshape(-1) - self.first                                                  # (D size k,)
            mine = ((local >= 0) & (local < self.count)).nonzero().squeeze(1)
            rows = tokens.new_zeros(local.shape[0], width)
            if mine.numel():
                pick = mine[local[mine].argsort(stable=True)]      # sorted by expert, as the experts take them
                rows[pick] = super().forward(tokens.index_select(0, pick // k), local[pick])
            out[start * k:(start + own.shape[0]) * k] = self.dp.reduce_scatter(rows)[:own.shape[0] * k]
        return out

    def _across_replicas_static(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """`_across_replicas` with no host read, for a decode step's CUDA graph (`lathe.engine.data_parallel`): every
        replica runs the same batch bucket, so `x` (n, H) has the same n everywhere and goes in one piece. The
        gathered (token, choice) rows are sorted by this rank's expert, the rows of other ranks' experts keyed past
        the last, so that the grouped matmul's offsets end at this rank's rows; those others' outputs are zeroed before
        the reduce-scatter. Outside a graph's warm-up or capture (`STATIC_ROWS`; a CPU check) the rows of this rank's
        experts are counted on the host."""
        k = chosen.shape[1]
        tokens = self.dp.gather(x)                                                  # (D n, H)
        local = self.dp.gather(chosen).reshape(-1) - self.first                     # (D n k,)
        mine = (local >= 0) & (local < self.count)
        key, order = torch.where(mine, local, torch.full_like(local, self.count)).sort(stable=True)
        rows = tokens.index_select(0, order // k)
        if STATIC_ROWS or capturing(x.device):      # (rows past the offsets: not computed, zeroed below)
            ran = super().forward(rows, key)
        else:                                       # (those rows as undefined: NaN, so that a check sees them zeroed)
            ran = torch.full_like(rows, float("nan"))
            m = int(mine.sum())
            ran[:m] = super().forward(rows[:m], key[:m])
        out = torch.empty_like(ran).index_copy_(0, order, ran)
        out = torch.where(mine.unsqueeze(-1), out, out.new_zeros(()))
        return self.dp.reduce_scatter(out)


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(mixin: type, cls: type) -> type:
    """`cls` with `mixin`'s forward in front (one class per pair, so compiled code sees one type)."""
    if (mixin, cls) not in _CLASSES:
        _CLASSES[mixin, cls] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[mixin, cls]
