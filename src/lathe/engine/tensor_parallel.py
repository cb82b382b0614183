"""Tensor-parallel engine replicas: one model over the `rollout.tensor_model_parallel_size` devices of a replica.

Megatron-LM's layout (Shoeybi et al. 2019, arXiv:1909.08053), as vLLM's engine runs it:
- attention: each rank holds `heads / tp` query heads (q_proj's rows of them, o_proj's columns) and their key/value
  heads (`kv_heads / tp` each; when tp exceeds the key/value heads, each is replicated on the `tp / kv_heads` ranks
  whose query heads use it), and so a KV cache of its own heads;
- MLP: each rank holds `intermediate / tp` columns of gate and up and the matching rows of down;
- o_proj and down_proj are row-parallel (`RowParallelLinear`): each rank's partial product is summed over the
  replica (one all-reduce each per layer), a bias added once after the sum;
- the LM head is vocabulary-parallel (`VocabParallelHead`): each rank computes the logits of its rows of the
  vocabulary and the replica gathers them, so every rank holds the same full logits and samples the same tokens;
- embeddings and norms are whole on every rank (a GPT-OSS layer's sink logits, one per query head, go with their
  heads);
- DeepSeek-V3's latent attention (the engine's cache holds each token's latent, whole on every rank: `lathe.engine.mla`):
  each rank holds its heads' rows of `q_proj` / `q_b_proj` and `kv_b_proj` (each head's k_nope and v from the
  latent) and `o_proj`'s columns of them; the low-rank down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their
  norms are whole, each rank computing the latent itself; its shared experts are cut like a dense MLP;
- the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): each rank holds key heads [r Hk/T, (r+1) Hk/T) of every
  linear-attention layer with their value heads, and so their recurrent and convolution states; `out_proj` is
  row-parallel; the gated attention's q_proj rows hold each head's query and output gate together (`_LinearSlices`);
- Nemotron-H (`lathe.models.nemotron_h`): its attention layers (`mixer.q_proj` ...) and relu^2 MLPs (`mixer.up_proj`,
  `mixer.down_proj`) are cut as above, its shared expert like a dense MLP; each rank holds heads [r H/T, (r+1) H/T)
  of every Mamba2 layer with their groups of B and C (T must divide the groups, so that each of the gated norm's
  groups lies on one rank), and so their convolution and scan states; `out_proj` is row-parallel (`_NemotronSlices`);
  the MoE's router and latent projections are whole, its experts placed as below;
- a mixture-of-experts layer runs expert-parallel (`rollout.expert_parallel_size` = the replica's size): each rank
  holds `num_experts / tp` whole experts and the whole router, and the block's partial output is summed by one
  all-reduce, like a row-parallel down_proj's (`lathe.engine.expert_parallel`, which says why no all-to-all is
  needed).
q/k/v and gate/up stay plain `nn.Linear`s over the rank's rows: the engine fuses them the same way
(`decode_forms.fuse_projections`). The collectives are torch's functional ones, which compiled layers trace and
CUDA graphs capture.

The ranks of a replica run the same engine on the same prompts: their schedulers take the same decisions as long
as their KV caches hold the same number of blocks (`TensorParallel.min_int`) and their samples agree (the gathered
logits are equal on every rank; `LatheEngine.generate` checks the outputs agree).

Weights arrive whole, by Hugging Face name (the trainer's gathered tensors after an update, or a checkpoint's):
`ShardLayout.local` cuts the rank's slice of each. A layout needs only the model's config and the rank's place, so
the trainer of fully-async training cuts each position's slices before sending them (`lathe.workers.reshard`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from lathe.engine.expert_parallel import ExpertSlice, check_sizes
from lathe.engine.multimodal import text_config
from lathe.models.config import LatheConfig
from lathe.models.vl import is_vl
from lathe.models.decoder import MLP, LatheCausalLM
from lathe.models.io import load_into
from lathe.models.mtp import MTP_PREFIX, mtp_layers
from lathe.models.moe import SparseMoeBlock


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its replica: the replica's process group, the rank within it and the replica's size."""

    group: object               # a torch.distributed ProcessGroup (None with size 1)
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _waited(funcol.all_reduce(x, "sum", self.group))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) from every rank, concatenated in rank order along the last dimension: (..., size * n)."""
        gathered = _waited(_ALL_GATHER(x.contiguous(), 0, self.group))                 # (size * lead, n)
        lead, n = x.shape[:-1], x.shape[-1]
        return gathered.view(self.size, -1, n).transpose(0, 1).reshape(*lead, self.size * n)

    def reduce_int(self, value: int, op: str) -> int:
        """`value` reduced over the replica (`op`: "min", "max" or "sum"), outside any graph."""
        if self.size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=_comm_device(self.group))
        dist.all_reduce(t, op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op],
                        group=self.group)
        return int(t.item())

    def min_int(self, value: int) -> int:
        return self.reduce_int(value, "min")


@dataclass(frozen=True)
class AttentionDataParallel:
    """Data-parallel attention (`lathe.engine.data_parallel`): this rank's place among the D replicas of its engine: the group of the ranks at its position in each replica,
    its replica's index and D."""

    group: object               # a torch.distributed ProcessGroup (None with size 1)
    rank: int
    size: int

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any replica (outside any graph)."""
        if self.size == 1:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=_comm_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def agree(self, values: list[int]) -> list[int]:
        """Each of `values`' maximum over the replicas (outside any graph)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=_comm_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def min_int(self, value: int) -> int:
        """The smallest `value` of the replicas."""
        return -self.agree([-value])[0]

    def counts(self, n: int) -> list[int]:
        """Each replica's `n`, in replica order."""
        t = torch.tensor([n], dtype=torch.int64, device=_comm_device(self.group))
        out = torch.empty(self.size, dtype=torch.int64, device=t.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out.tolist()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) from each replica (the same n everywhere), concatenated in replica order: (D n, ...)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(D n, ...) summed over the replicas, this replica's n rows of the sum."""
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size,) + x.shape[1:])
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out


# all_gather_single where this torch has it (all_gather_tensor, its old name, warns there as deprecated)
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for in eager mode (traced ones are waited for by the graph)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from lathe.device import current_device
    return current_device()


def replica_groups(size: int) -> TensorParallel:
    """This rank's replica among consecutive blocks of `size` ranks of the default process group (every rank must
    call it, in the same order: creating a group is collective). Consecutive ranks share a node when `size`
    divides the devices per node, which the config requires."""
    if size == 1:
        return TensorParallel(None, 0, 1)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"rollout.tensor_model_parallel_size={size}: a tensor-parallel replica spans {size} "
                           "ranks of a process group, and this process runs alone. Fix: run on Ray "
                           "(trainer.n_gpus_per_node >= the size), or set it to 1")
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"rollout.tensor_model_parallel_size={size} does not divide the {world} ranks")
    group, _ = dist.new_subgroups(group_size=size)
    return TensorParallel(group, dist.get_rank() % size, size)


# ---- which slice of each tensor a rank holds ----------------------------------------------------------------------

_LAYER = r"model\.(?:language_model\.)?layers\.\d+\."     # a decoder layer's names (a VL model's language model's)
# (Nemotron-H's attention and dense MLP: `mixer.q_proj` ..., `mixer.up_proj`, `mixer.down_proj`)
_NAME = re.compile(rf"^(?:{_LAYER}(?:(?:self_attn|mixer)\.(?P<attn>[qkvo])_proj"
                   r"|(?:mlp|mixer)\.(?P<mlp>gate|up|down)_proj)|(?P<head>lm_head))\.(?P<part>weight|bias)$")
_SINKS = re.compile(rf"^{_LAYER}self_attn\.sinks$")       # GPT-OSS: one logit per query head
# the hybrid families' linear-attention layers (`lathe.models.qwen3_5.GatedDeltaNet`)
_LINEAR = re.compile(rf"^{_LAYER}linear_attn\.(?P<what>in_proj_qkvz|in_proj_qkv|in_proj_z|in_proj_ba|"
                     r"in_proj_b|in_proj_a|conv1d|out_proj|dt_bias|A_log|norm)(?:\.weight)?$")
# a shared expert (Qwen3.5-MoE / Qwen3-Next: shared_expert; DeepSeek-V3: shared_experts), cut like a dense MLP
_SHARED = re.compile(rf"^{_LAYER}(?:mlp|mixer)\.shared_experts?\.(?P<proj>gate|up|down)_proj\.weight$")
# Nemotron-H's Mamba2 layers (`lathe.models.nemotron_h.Mamba2Mixer`)
_MAMBA = re.compile(rf"^{_LAYER}mixer\.(?P<what>in_proj|conv1d|dt_bias|A_log|D|norm|out_proj)"
                    r"(?:\.(?P<part>weight|bias))?$")
# DeepSeek-V3's latent attention: the per-head up-projections of the query and of the latent (`q_proj` without a
# query low rank is `_NAME`'s); the low-rank down-projections and their norms are whole
_MLA = re.compile(rf"^{_LAYER}self_attn\.(?P<proj>q_b|kv_b)_proj\.weight$")


# the token embeddings of lathe's text decoder and of a VL model's language model (`lathe.models.vl`), whose tensor
# names all take `model.language_model.` where the text decoder's take `model.` (the vision tower's stay whole)
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


class ShardLayout:
    """The slices of a `LatheConfig`'s tensors that rank `tp.rank` of a replica of `tp.size` holds (module doc)."""

    def __init__(self, cfg: LatheConfig, tp: TensorParallel, expert_parallel_size: int = 1, keep_mtp: bool = False,
                 dp=None):
        """`expert_parallel_size`: `rollout.expert_parallel_size` (a MoE model's must be the replica's size, or the
        engine's with `dp`); `keep_mtp`: a MiMo model's MTP layers are kept whole on every rank (speculative decoding
        drafts with them, `lathe.engine.mtp_draft`), else left out; `dp`: the rank's place among the replicas of a
        data-parallel-attention engine (`lathe.engine.data_parallel.AttentionDataParallel`), over whose ranks the
        experts are placed."""
        rank, size = tp.rank, tp.size
        self.dp = dp if dp is not None and dp.size > 1 else None
        dp_rank, dp_size = (self.dp.rank, self.dp.size) if self.dp is not None else (0, 1)
        check_sizes(cfg, size, expert_parallel_size, dp_size)
        nemotron = cfg.nemotron
        if nemotron is not None and size > 1 and cfg.mlp_bias:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: Nemotron-H with mlp_bias=true: the biases of "
                             "its latent projections and shared expert would be summed once per rank. Fix: set it to 1")
        heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        dense = (any(not cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)) if nemotron is None
                 else "mlp" in nemotron.block_types)                   # layers with a dense MLP
        problems = [f"{what} ({n}) are not divisible by it" for what, n in (
            ("the attention heads", heads), ("the MLP's intermediate features", inter if dense else 0)) if n % size]
        if kv % size and size % kv:
            problems.append(f"the key/value heads ({kv}) neither divide it nor are divisible by it")
        if problems:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: {'; '.join(problems)}. Fix: choose a "
                             f"size that divides {heads} attention heads and {inter} intermediate features")
        self.cfg, self.tp, self.rank, self.size = cfg, tp, rank, size
        self.keep_mtp = keep_mtp and cfg.num_mtp_layers > 0
        d = cfg.head_dim
        self.heads = (rank * heads // size, heads // size)                     # (first query head, heads)
        self.q = (self.heads[0] * d, self.heads[1] * d)                         # (first row, rows)
        la, mla = cfg.linear_attention, cfg.mla
        # q_proj's rows: each head's query, and in the hybrid families' gated attention its output gate beside it
        self.q_rows = self.q if la is None else (2 * self.q[0], 2 * self.q[1])
        self.linear = _LinearSlices(la, rank, size) if la is not None else None
        self.mamba = _NemotronSlices(nemotron.mamba, rank, size) if nemotron is not None else None
        self.mla = None
        if mla is not None:      # latent attention: per head a query of qk_head_dim, k_nope + v from the latent
            first, n = self.heads
            self.q_rows = (first * mla.qk_head_dim, n * mla.qk_head_dim)
            self.q = (first * mla.v_head_dim, n * mla.v_head_dim)             # o_proj's columns
            per = mla.qk_nope_head_dim + mla.v_head_dim
            self.mla = {"q_b": self.q_rows, "kv_b": (first * per, n * per)}
        # a shared expert's intermediate features (Qwen3.5-MoE / Qwen3-Next, DeepSeek-V3, GLM-4.5), cut as a dense MLP's
        shared = (la.shared_expert_intermediate_size if la is not None else
                  nemotron.shared_expert_intermediate_size if nemotron is not None and cfg.moe is not None else
                  cfg.moe.n_shared_experts * cfg.moe.moe_intermediate_size if cfg.moe is not None else 0)
        if shared % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the shared experts' intermediate features "
                             f"({shared}) are not divisible by it. Fix: choose a size that divides {shared}")
        self.shared = (rank * shared // size, shared // size) if shared else None
        kv_local = max(1, kv // size)
        first_kv = rank * kv // size if kv >= size else rank // (size // kv)
        self.kv = (first_kv * d, kv_local * d)
        self.inter = (rank * inter // size, inter // size) if dense else (0, inter)
        self.experts = (ExpertSlice(cfg.moe.num_experts, dp_rank * size + rank, dp_size * size)
                        if cfg.moe is not None else None)
        self.vocab_rows = -(-cfg.vocab_size // size)                           # padded: the last rank's may be short
        self.local_config = replace(cfg, num_attention_heads=heads // size, num_key_value_heads=kv_local,
                                    intermediate_size=self.inter[1], tie_word_embeddings=False,
                                    num_mtp_layers=0,      # MiMo's MTP layers: training only, left out of replicas
                                    linear_attention=None if la is None else replace(
                                        self.linear.local_config, shared_expert_intermediate_size=shared // size),
                                    nemotron=None if nemotron is None else replace(
                                        nemotron, mamba=self.mamba.local_config,
                                        shared_expert_intermediate_size=shared // size))

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor `name` (a view; the LM head's last slice padded with zero rows)."""
        m = _NAME.match(name)
        if m is None:
            shared = _SHARED.match(name) if self.shared is not None else None
            if shared is not None:
                return tensor.narrow(1 if shared["proj"] == "down" else 0, *self.shared)
            for slices in (self.linear, self.mamba):
                cut = slices.local(name, tensor) if slices is not None else None
                if cut is not None:
                    return cut
            mla = _MLA.match(name) if self.mla is not None else None
            if mla is not None:
                return tensor.narrow(0, *self.mla[mla["proj"]])
            return tensor.narrow(0, *self.heads) if _SINKS.match(name) else tensor
        attn, mlp, part = m["attn"], m["mlp"], m["part"]
        if m["head"]:
            start = self.rank * self.vocab_rows
            rows = tensor[start:start + self.vocab_rows]
            if rows.shape[0] < self.vocab_rows:
                rows = torch.cat([rows, rows.new_zeros((self.vocab_rows - rows.shape[0],) + rows.shape[1:])])
            return rows
        if attn == "o" or mlp == "down":                     # row-parallel: the input features; the bias is whole
            if part == "bias":
                return tensor
            start, n = self.q if attn == "o" else self.inter
            return tensor.narrow(1, start, n)
        start, n = self.q_rows if attn == "q" else self.kv if attn in ("k", "v") else self.inter
        return tensor.narrow(0, start, n)

    def local_items(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each (name, whole tensor) as (name, this rank's slice); a tied model's embeddings also give the LM head,
        and of a MoE model's experts only this rank's come (per-expert checkpoint names renumbered from 0); a MiMo
        model's MTP layers whole with `keep_mtp`, else none."""
        for name, tensor in named:
            if name.startswith(MTP_PREFIX):          # whole on every rank, or not in the replica (`local_config`)
                if self.keep_mtp:
                    yield name, tensor
                continue
            experts = self.experts.local(name, tensor) if self.experts is not None else None
            if experts is not None:
                yield from experts
                continue
            if name == "lm_head.weight" or (self.cfg.tie_word_embeddings and name in EMBEDDINGS):
                yield "lm_head.weight", self.local("lm_head.weight", tensor)
                if name == "lm_head.weight":
                    continue
            yield name, self.local(name, tensor)


class _LinearSlices:
    """A rank's share of the hybrid families' linear-attention layers (`lathe.models.qwen3_5`): key heads
    [r Hk/T, (r+1) Hk/T) with their value heads (Hv / Hk each: the convolution is per channel and the delta rule per
    head, so heads are independent, as under Ulysses). (Their shared experts are `ShardLayout`'s, as DeepSeek-V3's.)

    - `in_proj_qkv` and the convolution's channels: the rank's rows of each of the q, k and v sections;
      `in_proj_z`, `in_proj_b`, `in_proj_a`, `dt_bias`, `A_log`: its value heads; Qwen3-Next's grouped
      `in_proj_qkvz` / `in_proj_ba` ([q, k, v, z] and [b, a] per key head): its key heads' groups; `norm` (over one
      value head's features) whole;
    - `out_proj` is row-parallel (its columns: the rank's value heads), summed over the replica."""

    def __init__(self, la, rank: int, size: int):
        hk, hv = la.num_key_heads, la.num_value_heads
        if hk % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the linear-attention key heads ({hk}) are "
                             f"not divisible by it. Fix: choose a size that divides {hk} key heads")
        self.la, self.r = la, hv // hk
        self.keys = (rank * hk // size, hk // size)                 # (first key head, key heads)
        self.values = (self.keys[0] * self.r, self.keys[1] * self.r)   # their value heads
        self.local_config = replace(la, num_key_heads=self.keys[1], num_value_heads=self.values[1])

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's slice of a linear-attention tensor; None for any other."""
        m = _LINEAR.match(name)
        if m is None:
            return None
        la, what, (k0, kn), (v0, vn) = self.la, m["what"], self.keys, self.values
        dk, dv = la.key_head_dim, la.value_head_dim
        if what in ("in_proj_qkv", "conv1d"):                   # [q | k | v] sections
            key_dim = la.num_key_heads * dk
            return torch.cat([tensor.narrow(0, k0 * dk, kn * dk), tensor.narrow(0, key_dim + k0 * dk, kn * dk),
                              tensor.narrow(0, 2 * key_dim + v0 * dv, vn * dv)])
        if what == "in_proj_z":
            return tensor.narrow(0, v0 * dv, vn * dv)
        if what in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return tensor.narrow(0, v0, vn)
        if what == "in_proj_qkvz":                              # per key head: [q, k, v-group, z-group]
            per = 2 * dk + 2 * self.r * dv
            return tensor.narrow(0, k0 * per, kn * per)
        if what == "in_proj_ba":                                # per key head: [b-group, a-group]
            return tensor.narrow(0, k0 * 2 * self.r, kn * 2 * self.r)
        if what == "out_proj":
            return tensor.narrow(1, v0 * dv, vn * dv)
        return tensor                                           # norm: over one value head's features


class _NemotronSlices:
    """A rank's share of Nemotron-H's Mamba2 layers: heads [r H/T, (r+1) H/T) with their groups of B and C
    [r G/T, (r+1) G/T) (the convolution is per channel and the scan per head, each head reading its group's B and C;
    the gated norm normalises over one group's H P / G channels, so T must divide the groups).

    - `in_proj`'s rows: the rank's heads' z and x channels, its groups' B and C, its heads' dt; the convolution's
      channels (weight and bias): its x, B and C channels; `dt_bias`, `A_log`, `D`: its heads; the norm's weight: its
      channels;
    - `out_proj` is row-parallel (its columns: the rank's channels), summed over the replica."""

    def __init__(self, mamba, rank: int, size: int):
        h, g = mamba.num_heads, mamba.n_groups
        if g % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size}: the Mamba2 layers' groups ({g}, n_groups) "
                             f"are not divisible by it (each group's gated norm must lie on one rank). Fix: choose a "
                             f"size that divides {g}")
        self.m = mamba
        self.heads = (rank * h // size, h // size)
        self.groups = (rank * g // size, g // size)
        self.local_config = replace(mamba, num_heads=h // size, n_groups=g // size)

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's slice of a Mamba2 tensor; None for any other."""
        m = _MAMBA.match(name)
        if m is None:
            return None
        what, p, n = m["what"], self.m.head_dim, self.m.state_size
        (h0, hn), (g0, gn) = self.heads, self.groups
        inner, bc = self.m.inner, self.m.n_groups * n
        channels = (h0 * p, hn * p)

        def x_b_c(start: int) -> list[torch.Tensor]:        # the x, B and C sections from row `start` on
            return [tensor.narrow(0, start + channels[0], channels[1]),
                    tensor.narrow(0, start + inner + g0 * n, gn * n),
                    tensor.narrow(0, start + inner + bc + g0 * n, gn * n)]
        if what == "in_proj":                                   # [z | x | B | C | dt]
            return torch.cat([tensor.narrow(0, *channels), *x_b_c(inner),
                              tensor.narrow(0, 2 * inner + 2 * bc + h0, hn)])
        if what == "conv1d":                                    # [x | B | C]
            return torch.cat(x_b_c(0))
        if what in ("dt_bias", "A_log", "D"):
            return tensor.narrow(0, h0, hn)
        if what == "norm":
            return tensor.narrow(0, *channels)
        return tensor if m["part"] == "bias" else tensor.narrow(1, *channels)      # out_proj: row-parallel


# ---- the sharded modules -------------------------------------------------------------------------------------------


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of the input features: the partial products summed over the replica, then
    the (whole) bias added once."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Module):
    """The LM head over this rank's rows of the vocabulary; returns the whole logits (gathered over the replica)."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(nn.functional.linear(x, self.weight))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]


def check_replica(model, size: int, expert_parallel_size: int = 1, data_parallel_size: int = 1) -> None:
    """Raise unless `model` can be cut over a tensor-parallel replica of `size` ranks (lathe's text decoder,
    heads/features/experts that divide): what `shard_copy` checks, without a process group, so a run can refuse
    before its workers start."""
    if type(model) is not LatheCausalLM and not is_vl(model):
        raise NotImplementedError(
            f"rollout.tensor_model_parallel_size={size}: tensor-parallel engine replicas run lathe's text decoder "
            f"(Llama, Mistral, Seed-OSS, Qwen2, Qwen3, Qwen3-MoE, GPT-OSS, Qwen3.5, Qwen3.5-MoE, Qwen3-Next, "
            f"DeepSeek-V3, GLM-4.5, Nemotron-H) and its VL "
            f"models; this model is {type(model).__name__}. Fix: set it to 1")
    if is_vl(model) and data_parallel_size > 1:
        raise NotImplementedError(
            f"rollout.data_parallel_size={data_parallel_size}: data-parallel attention engines for a vision-language "
            f"model ({model.config.architecture}) are not implemented yet. Fix: set rollout.data_parallel_size=1 "
            f"(tensor-parallel replicas, rollout.tensor_model_parallel_size, run it)")
    dp = AttentionDataParallel(None, 0, data_parallel_size) if data_parallel_size > 1 else None
    ShardLayout(text_config(model), TensorParallel(None, 0, size), expert_parallel_size, dp=dp)     # its size checks


def shard_copy(model: LatheCausalLM, dtype: torch.dtype, device: torch.device, tp: TensorParallel, *,
               state: Iterable[tuple[str, torch.Tensor]] | None = None,
               expert_parallel_size: int = 1, keep_mtp: bool = False, dp=None) -> LatheCausalLM:
    """This rank's part of `model` (lathe's text decoder) for a tensor-parallel replica, in `dtype` on `device`: each
    tensor's slice is cut on the way (the whole model is never copied to the device). `state`: (name, tensor) pairs
    to take instead of the model's own (a LoRA model's merged weights). `expert_parallel_size`:
    `rollout.expert_parallel_size` (a MoE model's experts are placed over the replica when it is `tp.size`). The
    result's `tensor_parallel` is its `ShardLayout`, whose `local_items` cuts whole weights for `update_weights`.
    `keep_mtp`: a MiMo model's MTP layers come whole (speculative decoding; see `ShardLayout`). `dp`: the rank's
    place among a data-parallel-attention engine's replicas (`lathe.engine.data_parallel`; a replica of one rank
    then is the whole model but for its experts)."""
    check_replica(model, tp.size, expert_parallel_size, dp.size if dp is not None else 1)
    layout = ShardLayout(text_config(model), tp, expert_parallel_size, keep_mtp=keep_mtp, dp=dp)
    named = state if state is not None else model.state_dict().items()
    local = {k: v.detach().to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True).contiguous()
             for k, v in layout.local_items(named)}
    cfg = layout.local_config
    vl = is_vl(model)       # a VL model: its language model cut as the text decoder, its vision tower whole
    with torch.device("meta"):
        out = (type(model)(replace(model.config, text=cfg, tie_word_embeddings=False)) if vl else
               LatheCausalLM(cfg))
        for layer in (out.model.language_model if vl else out.model).layers:
            if layout.shared is not None and hasattr(getattr(layer, "mlp", None), "shared_experts"):  # DeepSeek-V3
                layer.mlp.shared_experts = MLP(replace(cfg, intermediate_size=layout.shared[1], mlp_bias=False))
            linear = getattr(layer, "linear", False)              # a hybrid family's linear-attention layer
            if hasattr(layer, "block_type"):                      # Nemotron-H: one mixer (its MoE's: as below)
                row = {"linear_attention": "out_proj", "full_attention": "o_proj", "mlp": "down_proj"}
                row_parallel = [getattr(layer.mixer, row[layer.block_type])] if layer.block_type in row else []
            else:
                row_parallel = [layer.linear_attn.out_proj if linear else layer.self_attn.o_proj]
            if hasattr(layer, "mlp") and not isinstance(layer.mlp, SparseMoeBlock):   # sparse: `ExpertSlice.place`
                row_parallel.append(layer.mlp.down_proj)
            for linear in row_parallel if tp.size > 1 else ():
                linear.__class__ = RowParallelLinear
                linear.tp = tp
        if tp.size > 1:
            out.lm_head = VocabParallelHead(layout.vocab_rows, cfg.hidden_size, cfg.vocab_size, tp)
        if layout.keep_mtp:         # whole layers of the whole model's shapes (plain linears: no collective)
            out.model.mtp_layers = mtp_layers(model.config)
        if layout.experts is not None:
            layout.experts.place(out, tp, layout.dp)
    load_into(out, local, "the actor's weights", hub=False)
    if vl:
        from lathe.models.vl.vision import rebuild_meta_buffers
        rebuild_meta_buffers(out.model.visual, device)
    out.tensor_parallel = layout
    return out.requires_grad_(False).eval()


def layout_of(model) -> ShardLayout | None:
    """The `ShardLayout` of a model made by `shard_copy`, None for a whole model."""
    return getattr(model, "tensor_parallel", None)
