"""Ulysses sequence parallelism for training's packed forward (verl's `ulysses_sequence_parallel_size`).

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models", arXiv:2309.14509). With size S over the W ranks of a worker group (W % S == 0),
ranks gS .. gS+S-1 form sequence-parallel group g, and the ranks at the same place s of every group form a
data-parallel group of W/S ranks. The driver gives every rank of a sequence-parallel group the same share of each
batch, so they cut it into the same micro-batches; each micro-batch's packed stream of T tokens is padded to a
multiple of S (`padded_length`) and rank s runs every layer on tokens [s T/S, (s+1) T/S) only. Attention needs all
tokens of a sequence, so around it (`UlyssesAttention`) one all-to-all turns each rank's q, k, v from (T/S tokens,
H heads) into (T tokens, H/S heads), attention runs over whole sequences for those heads, and a second all-to-all
turns the output back into (T/S tokens, H heads). Activations per rank shrink by S; the weights stay sharded by
FSDP2 over all W ranks. Positions (RoPE) are those of the whole stream, sliced with the tokens.

Heads: the query heads and the key/value heads are split over the S ranks, so S must divide both; with fewer
key/value heads than S (grouped-query attention), each key/value head is repeated S / heads times first (as verl
does), which keeps every rank's query heads with their own key/value head when S is a multiple of the key/value
heads (`check_model`). MiMo's multi-token-prediction layers are decoder layers of the same heads: training runs them
on the rank's slice under the main forward's `UlyssesAttention` (`lathe.train.mtp`).

With tensor parallelism T in the same model (`lathe.train.tensor_parallel`; torchtitan's and Megatron's layout,
the world mesh read as (dp, sp, tp), tp innermost): a block of S x T consecutive ranks holds one share of the data;
within it, the T ranks of a tensor-parallel group are consecutive and compute the same token slice, and the S ranks
at the same place of the block's tensor-parallel groups (strided by T) form a sequence-parallel group
(`sequence_parallel(size, tp=T)`). A rank's attention holds its H/T local heads (the column-parallel q/k/v), and the
all-to-all splits those again over the S ranks: each rank runs attention on whole sequences for H/(T S) heads, and
the key/value heads are checked (and repeated) as above on the H_kv/T local ones. Norms, RoPE and the row-parallel
all-reduces work on the rank's slice of tokens; the vocabulary-parallel log-probs (`lathe.train.vocab_parallel`) are
computed on the slice over the tensor-parallel group and then gathered over the sequence-parallel one. Sums over
distinct data run over the ranks strided by S x T (`data_group`); FSDP2 shards over the world / T ranks of the mesh's
shard dim, which holds the sequence-parallel ranks too, so their partial gradients add up as above.

Linear attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next's gated-DeltaNet layers) carries a state along each whole
sequence, so it is split the same way: each rank projects its slice, one all-to-all hands it all T tokens of Hk/S
key heads with their value heads (the short convolution is per channel, the gated delta rule per head), and a second
one brings the outputs back (`lathe.models.qwen3_5.GatedDeltaNet.head_parallel`, through `UlyssesAttention.to_heads`
and `to_tokens`); S must divide the linear layers' key heads (a tensor-parallel rank's Hk/T beside TP: `check_model`).

A vision-language model (`lathe.models.vl`) splits its language model's packed stream the same way: every rank of a
group splices the images into the whole stream's embeddings first, then takes its slice of them, of the 3D positions,
of the placeholders and of Qwen3-VL's deepstack rows (`LatheVLForConditionalGeneration.hidden_with`); its vision
tower, whole on every rank, gets each rank's partial gradient, summed as every other weight's.

Gradients. Each rank computes its slice's per-token results (log-probs, entropy, values) and `gather_tokens` joins
the group's slices, so every rank of the group holds the whole micro-batch's results and computes the same loss L
from them (normalised by counts summed over the data-parallel group only: `data_group`). The backward of the gather
hands each rank the gradient of L for its own slice only (not the sum over the group, which would count L S times);
the backward of the all-to-alls routes each token's gradient to the rank that computed it. The parameter gradients
of the S ranks therefore add up to dL/dtheta once, and FSDP2's reduce-scatter, which sums over all W ranks
(`lathe.train.parallel`: divide factor 1), sums each micro-batch's gradient once and the data-parallel groups' micro-
batches together: the gradient of the undivided mini-batch, exactly as without sequence parallelism.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lathe.train import parallel


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the sequence-parallel layout of one size."""

    size: int              # S: ranks that compute one micro-batch together
    rank: int              # this rank's place in its group: which slice of the tokens it computes
    group: Any             # the S ranks of this rank's sequence-parallel group (they hold the same micro-batches)
    data_group: Any        # the W/S ranks at this rank's place in every group: sums over distinct data go here


def sequence_parallel(size: int, key: str = "ulysses_sequence_parallel_size", tp: int = 1
                      ) -> SequenceParallel | None:
    """This rank's `SequenceParallel` of `size` (None for 1: no sequence parallelism), beside the model's tensor-
    parallel size `tp` (its groups of `tp` consecutive ranks: the sequence-parallel groups then stride over them,
    module doc). The process groups are made once per layout; every rank of the worker group must call this, in the
    same order (`dist.new_group`)."""
    if size == 1:
        return None
    world = parallel.world_size()
    if size < 1 or world % (size * tp):
        beside = f" x the tensor-parallel size {tp}" if tp > 1 else ""
        raise ValueError(f"{key}={size}{beside} must divide the worker group's {world} rank(s): its ranks form "
                         f"groups of {size * tp} that hold the same data. Fix: set {key} so that it does (1: no "
                         f"sequence parallelism).")
    return _layout(size, dist.group.WORLD, tp)


def consecutive_groups(size: int) -> SequenceParallel:
    """The layout of groups of `size` consecutive ranks over the worker group, with the strided data-parallel groups
    across them (a tensor-parallel group has the same); made once per size. Collective (`dist.new_group`)."""
    return _layout(size, dist.group.WORLD)


@functools.lru_cache(maxsize=None)
def _layout(size: int, world_group, stride: int = 1) -> SequenceParallel:
    """Groups of `size` ranks `stride` apart within blocks of size x stride consecutive ranks (stride: the tensor-
    parallel size; 1: consecutive ranks), and the data groups of the ranks at the same place of every block. (Keyed
    by the default group too: a process that joins a new one makes new groups.)"""
    world, me, block = parallel.world_size(), parallel.rank(), size * stride
    sp, _ = dist.new_subgroups_by_enumeration([[b + t + s * stride for s in range(size)]
                                               for b in range(0, world, block) for t in range(stride)])
    dp, _ = dist.new_subgroups_by_enumeration([list(range(j, world, block)) for j in range(block)])
    return SequenceParallel(size=size, rank=(me // stride) % size, group=sp, data_group=dp)


def check_model(model, size: int, key: str, tp: int = 1, tp_key: str = "fsdp_config.tensor_parallel_size") -> None:
    """Raise unless `model` can run with sequence-parallel `size`: lathe's text decoder (or value model), query
    heads divisible by the size, key/value heads divisible by it or dividing it, positions that do not depend on
    the forward's length. Beside tensor parallelism `tp` (its key `tp_key`) the heads are those of one tensor-
    parallel rank (module doc): tp x size must divide the query heads, tp the key/value heads, and size divide the
    rank's key/value heads or be a multiple of them."""
    if size == 1:
        return
    from lathe.models.vl import is_vl
    if not is_vl(model):        # a VL model's language model splits as a text model does (`hidden_with`)
        require_text_decoder(model, size, key, "run with Ulysses sequence parallelism")
    c = getattr(model.config, "text", model.config)
    nemotron = getattr(c, "nemotron", None)
    if nemotron is not None and (nemotron.mamba.n_groups // tp) % size:     # (tp divides them: its own check)
        groups = nemotron.mamba.n_groups // tp
        ok = [s for s in range(1, groups + 1) if groups % s == 0]
        beside = f" per rank of a tensor-parallel group of {tp} ({tp_key})" if tp > 1 else ""
        raise ValueError(f"{key}={size}: {c.architecture}'s Mamba2 layers have {groups} groups of heads (n_groups)"
                         f"{beside}, which are split over the {size} ranks of a group with their heads and B, C, so "
                         f"{size} must divide {groups}. Fix: set {key} to {' or '.join(map(str, ok[-3:]))}.")
    la = getattr(c, "linear_attention", None)
    if la is not None and (la.num_key_heads // tp) % size:       # (tp divides them: the tensor-parallel check)
        mine = la.num_key_heads // tp
        ok = [s for s in range(1, mine + 1) if mine % s == 0]
        beside, all_ = (f" per rank of a tensor-parallel group of {tp} ({tp_key})", " in all") if tp > 1 else ("", "")
        raise ValueError(f"{key}={size}: {c.architecture}'s linear-attention layers have {mine} key heads{beside} "
                         f"({la.num_value_heads} value heads{all_}), which are split over the {size} ranks of a group "
                         f"with their value heads, so {size} must divide {mine}. Fix: set {key} to "
                         f"{' or '.join(map(str, ok[-3:]))}.")
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    if tp > 1 and (heads % (tp * size) or kv % tp or (kv // tp % size and size % (kv // tp))):
        raise ValueError(f"{key}={size} with {tp_key}={tp}: each rank of a tensor-parallel group holds 1/{tp} of the "
                         f"model's {heads} query heads and {kv} key/value heads, and the Ulysses all-to-all splits "
                         f"those again over the {size} ranks of a sequence-parallel group, so {tp} x {size} must "
                         f"divide {heads}, {tp} must divide {kv}, and {size} must divide the key/value heads of a "
                         f"rank ({kv}/{tp}) or be a multiple of them. Fix: set ({tp_key}, {key}) to such sizes, e.g. "
                         f"{_fitting_pairs(heads, kv, tp * size)}.")
    if tp == 1 and (heads % size or (kv % size and size % kv)):
        raise ValueError(f"{key}={size}: the model's {heads} query heads and {kv} key/value heads are split over the "
                         f"{size} ranks of a group, so {size} must divide {heads} and divide {kv} or be a multiple "
                         f"of it. Fix: set {key} to such a size, e.g. {_fitting(heads, kv)}.")
    if c.rope.rope_type == "dynamic":
        raise ValueError(f"{key}={size}: dynamic NTK RoPE scales the frequencies by the longest position of a "
                         f"forward, which each rank of a group sees only a slice of. Fix: set {key}=1.")


def require_text_decoder(model, size: int, key: str, what: str) -> None:
    """Raise unless `model` is lathe's text decoder or value model (the hybrids' among them): the only ones a
    parallelism `key` of `size` can split (`what` it does to them, for the message)."""
    from lathe.models.decoder import LatheCausalLM, LatheValueModel
    if not isinstance(model, (LatheCausalLM, LatheValueModel)):
        raise ValueError(f"{key}={size} needs lathe's text decoder (Llama, Qwen2, Qwen3, Qwen3.5 and their value "
                         f"models), but this role runs {type(model).__name__}; a vision-language or transformers "
                         f"model cannot {what} in lathe yet. Fix: set {key}=1.")


def _fitting_pairs(heads: int, kv: int, most: int) -> str:
    """'(tp, sp)' pairs of sizes whose product is at most `most` that split `heads` and `kv` (`check_model`), the
    largest products first."""
    ok = [(t, s) for t in range(2, kv + 1) if kv % t == 0 and heads % t == 0
          for s in range(2, heads // t + 1) if t * s <= most and heads // t % s == 0
          and (kv // t % s == 0 or s % (kv // t) == 0)]
    ok.sort(key=lambda pair: -pair[0] * pair[1])
    return " or ".join(f"({t}, {s})" for t, s in ok[:3]) or "none with both above 1 (set one of them to 1)"


def _fitting(heads: int, kv: int) -> str:
    ok = [s for s in range(1, heads + 1) if heads % s == 0 and (kv % s == 0 or s % kv == 0)]
    return " or ".join(str(s) for s in ok[-3:])


# -- slicing the packed stream -------------------------------------------------------------------------------------
def padded_length(tokens: int, size: int) -> int:
    """The packed stream's length padded to a multiple of `size` (each rank computes length / size tokens)."""
    return -(-tokens // size) * size


def local_slice(x: torch.Tensor, sp: SequenceParallel, fill: int = 0) -> torch.Tensor:
    """This rank's slice of a packed (T, ...) tensor, padded with `fill` to `padded_length(T)` first."""
    T = x.shape[0]
    pad = padded_length(T, sp.size) - T
    if pad:
        x = torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)])
    per = x.shape[0] // sp.size
    return x[sp.rank * per:(sp.rank + 1) * per]


# -- the collectives, differentiable ------------------------------------------------------------------------------
def _tokens_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(T/S, H, D) on each rank -> (T, H/S, D): every rank's tokens for this rank's heads."""
    n, heads = x.shape[0], x.shape[1]
    send = x.reshape(n, sp.size, heads // sp.size, *x.shape[2:]).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)                          # recv[i]: rank i's tokens of this rank's heads
    dist.all_to_all_single(recv, send, group=sp.group)
    return recv.reshape(sp.size * n, heads // sp.size, *x.shape[2:])


def _heads_to_tokens(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(T, H/S, D) -> (T/S, H, D): the inverse of `_tokens_to_heads`."""
    send = x.reshape(sp.size, x.shape[0] // sp.size, *x.shape[1:]).contiguous()
    recv = torch.empty_like(send)                          # recv[i]: this rank's tokens of rank i's heads
    dist.all_to_all_single(recv, send, group=sp.group)
    n, part = recv.shape[1], recv.shape[2]
    return recv.transpose(0, 1).reshape(n, sp.size * part, *recv.shape[3:])


class _AllToAll(torch.autograd.Function):
    """`_tokens_to_heads` (or its inverse); the backward is the other one."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _tokens_to_heads(x, sp) if to_heads else _heads_to_tokens(x, sp)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (_heads_to_tokens(grad, ctx.sp) if ctx.to_heads else _tokens_to_heads(grad, ctx.sp)), None, None


class _GatherTokens(torch.autograd.Function):
    """Every rank's (n, ...) slice joined in rank order; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.n = sp, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        # every rank of the group computes the same loss from the joined values: the gradient of that loss for
        # this rank's slice is its part of the output gradient (summing the group's would count the loss S times)
        return grad[ctx.sp.rank * ctx.n:(ctx.sp.rank + 1) * ctx.n], None


def gather_tokens(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(T/S, ...) per rank -> (T, ...) on every rank of the group, differentiable (see the module docstring)."""
    return _GatherTokens.apply(x, sp)


@dataclass
class UlyssesAttention:
    """Attention over a sequence-parallel group's packed stream (an `AttentionFn`): this rank's q (T/S, Hq, D) and
    k, v (T/S, Hkv, D) exchanged for all T tokens of Hq/S heads, `inner` (attention over the whole padded stream,
    e.g. `PackedAttention` with its `cu_seqlens`) run on them, the output exchanged back to (T/S, Hq, D).
    `to_heads` and `to_tokens` are the two exchanges, for layers that split other per-head work the same way
    (linear attention: module doc)."""

    inner: Any
    sp: SequenceParallel
    rotates: ClassVar[bool] = False       # takes q and k rotated

    @property
    def layer_options(self) -> bool:
        """GPT-OSS's sinks and windows (`lathe.models.attention`), where the inner attention takes them."""
        return getattr(self.inner, "layer_options", False)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole packed stream's (T, ...) tensor (`local_slice`): what a model that builds
        its inputs from the whole stream (a VL model's image splice) hands its layers."""
        return local_slice(x, self.sp)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        size = self.sp.size
        if k.shape[1] < size:             # fewer key/value heads than ranks: each repeated (check_model)
            k, v = (x.repeat_interleave(size // x.shape[1], dim=1) for x in (k, v))
        if options.get("sinks") is not None:    # a sink per query head: this rank's heads' (`to_heads`)
            share = q.shape[1] // size
            options["sinks"] = options["sinks"][self.sp.rank * share:(self.sp.rank + 1) * share]
        # (a window is by position within a sequence: after the exchange each rank holds every token of its heads)
        return self.to_tokens(self.inner(*(self.to_heads(x) for x in (q, k, v)), **options))

    @torch.compiler.disable
    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(T/S tokens, H heads, ...) on each rank -> (T tokens, H/S heads, ...): this rank's share, heads
        [rank H/S, (rank+1) H/S); differentiable; eager in a compiled layer (as `decoder.attend`)."""
        return _AllToAll.apply(x, self.sp, True)

    @torch.compiler.disable
    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`: (T, H/S, ...) -> (T/S, H, ...)."""
        return _AllToAll.apply(x, self.sp, False)


# -- the routers' load-balancing loss ------------------------------------------------------------------------------
def router_totals(stats, sp: SequenceParallel) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`lathe.models.moe.RouterStats.totals` of the group's whole micro-batch, each rank having recorded its slice's
    real tokens (`lathe.train.router_tokens`): summed over the group, so that every rank computes the load-balancing
    loss of the whole micro-batch, as one process does. The probabilities' sum hands back to each rank the gradient for its own
    (every rank computes the same loss from the sums: as `gather_tokens`)."""
    counts, probs, rows = stats.totals()
    both = torch.cat([counts.to(probs.device), torch.tensor([float(rows)], device=probs.device)])
    dist.all_reduce(both, group=sp.group)
    return both[:-1], _SumOverGroup.apply(probs, sp), int(both[-1])


def router_layer_totals(stats, sp: SequenceParallel):
    """`lathe.models.moe.RouterStats.per_layer` of the group's whole micro-batch (as `router_totals`, layer by
    layer): every rank computes Megatron's router losses of the whole micro-batch; None when no sparse layer ran."""
    layers = stats.per_layer()
    if layers is None:
        return None
    counts, probs, z, rows = layers
    plain = torch.cat([counts, rows[:, None]], dim=1)
    dist.all_reduce(plain, group=sp.group)
    return plain[:, :-1], _SumOverGroup.apply(probs, sp), _SumOverGroup.apply(z, sp), plain[:, -1]


class _SumOverGroup(torch.autograd.Function):
    """The group's sum of a tensor; the backward keeps this rank's gradient (see `router_totals`)."""

    @staticmethod
    def forward(ctx, x, sp):
        out = x.clone()
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
