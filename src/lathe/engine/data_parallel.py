"""Data-parallel attention: one engine of D replicas of T ranks whose mixture-of-experts layers span all D x T ranks.

verl's `rollout.data_parallel_size` D with `expert_parallel_size` D x T is vLLM/SGLang's data-parallel attention:
attention (and the rest of each layer but the routed experts) runs data-parallel, each of D replicas (of T
tensor-parallel ranks, `lathe.engine.tensor_parallel`) on sequences of its own, while the routed experts are spread
over all D x T ranks, so that a rank holds num_experts / (D x T) of them instead of num_experts / T. That is what lets
a model whose experts would not fit T devices (Qwen3.5-397B-A17B over TP 8: 16 replicas, EP 128) generate at all,
and leaves the KV cache the room the experts no longer take.

The pieces:
- `engine_groups`: the replica's group and the group of the D ranks at the same position of the engine's replicas
  (ranks e D T + d T + t for d < D: consecutive ranks form replicas, consecutive replicas an engine);
- the experts (`lathe.engine.expert_parallel.LocalExperts`) gather the tokens and their choices of their group, run
  their own experts' rows and hand each rank back its rows' outputs with a reduce-scatter;
- lockstep: every layer's gather is a collective of the D replicas, so their engines run their forwards together.
  `LatheEngine.generate` goes on while any replica has work (`AttentionDataParallel.any`, once a step); a replica
  with none runs `idle_step`: its experts take part in each sparse layer's collectives with no rows of their own.
  Each replica still schedules, samples and seeds its own sequences (the samples of a call are those of one
  process given the same `first_index`), and its KV cache is its own.

Decode under CUDA graphs (where the engine has them: a MoE model's grouped matmul, Hopper, bf16): each step, after
scheduling, one all-reduce (max) among the replicas of (prefill?, decode batch, top-k search?, top-p search?)
(`LatheEngine._dp_agree`): any prefill, or a batch past the largest bucket, and every replica runs the step eagerly
(a decode replica too); else every replica replays the graph of one agreed key (the bucket of the largest batch, the
union of the sampler's searches), an idle replica with padding rows only. The key must be the same everywhere: a
capture runs the step once eagerly first (its collectives execute) and then records (they do not), so a replica
capturing while another replays would pair one's warm-up collectives with the other's replay. Under capture the
experts take the bucket's rows in one piece (`LocalExperts._across_replicas_static`): the (token, choice) rows sorted
by this rank's expert, other ranks' experts' rows keyed past the last so that the grouped matmul's offsets end at
this rank's rows (it computes those only), their outputs zeroed before the reduce-scatter. Checked on CPU (the
experts' static path equals the eager one bit for bit over gloo) and on 2 H200s
(`tests/engine/test_data_parallel_gpu.py`: the graphs sample what eager decode samples); a rank leaves its process
group only after its engine's graphs are freed (with them alive, destroy_process_group hung).

Streamed requests (`add_request`, `step`): the agent loop drives its replica's `step` in the replicas' lockstep
(`AgentLoop._run`: one agreement a turn of its loop; `dp_idle` for a replica with nothing to run). On replicas of
several tensor-parallel ranks the loop runs on each replica's leader, the leaders agree among themselves (over the
data-parallel group of position 0), and each leader tells its followers every step and idle step
(`lathe.workers.lockstep`), so the ranks at each position join the same collectives. Fully-async training's
replicas stream their requests the same way, each leader's engine thread agreeing with the others' every tick
(`lathe.workers.fully_async.RolloutWorker`); their weight sync sends whole tensors to every rank, which keeps its
slices and its own experts. Not here yet: speculative decoding.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from lathe.engine.tensor_parallel import AttentionDataParallel, TensorParallel, replica_groups
from lathe.models.moe import sparse_blocks

KEY = "rollout.data_parallel_size"
log = logging.getLogger("lathe")


NO_DATA_PARALLEL = AttentionDataParallel(None, 0, 1)


def dp_settings(model: nn.Module, enforce_eager: bool, num_speculative_tokens: int) -> bool:
    """`enforce_eager` for a replica of a data-parallel-attention engine (as asked: its decode graphs are agreed
    among the replicas, module doc); speculative decoding is refused."""
    if num_speculative_tokens:
        raise ValueError(f"{KEY} > 1 (data-parallel attention) with speculative decoding (num_speculative_tokens="
                         f"{num_speculative_tokens}): not implemented together yet. Fix: leave one of them off")
    return enforce_eager


def engine_groups(tp_size: int, dp_size: int) -> tuple[TensorParallel, AttentionDataParallel]:
    """(this rank's replica, its place among its engine's `dp_size` replicas) in the default process group, whose
    consecutive ranks form replicas of `tp_size` and consecutive replicas engines (module doc). Every rank must call it
    in the same order: creating groups is collective."""
    tp = replica_groups(tp_size) if tp_size > 1 else TensorParallel(None, 0, 1)
    if dp_size == 1:
        return tp, NO_DATA_PARALLEL
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{KEY}={dp_size}: data-parallel attention spans {dp_size} replicas of one process group, "
                           "and this process runs alone. Fix: run on Ray, or set it to 1")
    world, ranks = dist.get_world_size(), tp_size * dp_size
    if world % ranks:
        raise ValueError(f"{KEY}={dp_size} x rollout.tensor_model_parallel_size={tp_size} = {ranks} ranks an engine, "
                         f"which does not divide the {world} ranks")
    positions = [[e * ranks + d * tp_size + t for d in range(dp_size)]
                 for e in range(world // ranks) for t in range(tp_size)]
    group, _ = dist.new_subgroups_by_enumeration(positions)
    return tp, AttentionDataParallel(group, dist.get_rank() % ranks // tp_size, dp_size)


def verl_expert_layout(ro) -> bool:
    """Whether the loaded rollout config `ro` keeps verl's EP = D x TP with D > 1: an engine of data-parallel
    attention, whose replicas step in lockstep, for a model `engine_layout` lets drive it."""
    dp = ro.data_parallel_size
    return dp > 1 and ro.expert_parallel_size == dp * ro.tensor_model_parallel_size


def engine_layout(model: nn.Module, ro) -> tuple[int, int]:
    """(data-parallel size, expert-parallel size) of `model`'s engine under the loaded rollout config `ro` (which
    keeps verl's EP = D x TP only where data-parallel attention can drive the engine:
    `lathe.config.verl_translate.engine_data_parallel`): data-parallel attention (D, D x TP) for lathe's text decoder
    of a mixture-of-experts model; replicas for a dense model (no experts to spread: the same thing) and for a
    model lathe's decoder does not run (whole experts, with a notice)."""
    tp, dp, ep = ro.tensor_model_parallel_size, max(1, ro.data_parallel_size), ro.expert_parallel_size
    if dp > 1 and getattr(getattr(model, "config", None), "moe", None) is None:
        return 1, 1             # (an expert-parallel size that came with the data-parallel one: nothing to place)
    if not verl_expert_layout(ro):
        return 1, ep
    from lathe.models.decoder import LatheCausalLM
    if not isinstance(model, LatheCausalLM):
        log.info("engine: %s=%d runs as replicas of whole experts for %s (data-parallel attention runs lathe's text "
                 "decoder)", KEY, dp, type(model).__name__)
        return 1, tp
    return dp, ep


@torch.inference_mode()
def idle_step(model: nn.Module) -> None:
    """A replica without sequences, while another has some: its experts take part in one forward's collectives
    (module doc), layer by layer, with no rows of their own."""
    for block in sparse_blocks(model):
        experts = block.experts
        if getattr(experts, "token_major", None) is None:
            continue
        weight = next(experts.parameters())
        experts.token_major(weight.new_zeros(0, block.moe_hidden),
                            torch.zeros(0, block.moe.num_experts_per_tok, dtype=torch.int64, device=weight.device))
