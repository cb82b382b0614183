"""lathe.train.expert_parallel beside lathe.train.tensor_parallel: a Qwen3-MoE model with its experts placed over the
ranks of its tensor-parallel group (expert_parallel_size == tensor_parallel_size) equals the one-process computation.

One group of 2 gloo ranks (forks of one forkserver, as `test_parallel`'s), all checks in it, and one of 4:
- a float64 Qwen3-MoE sparse layer, its 4 experts over the 2 ranks (2 each), every rank given all the tokens (as a
  tensor-parallel group is): each rank's output and input gradient are the whole one-process layer's, the router's
  gradient the same on both ranks and the one-process one, each rank's experts' gradients its rows of it;
- the actor worker (AdamW, clipped gradients) on a tiny Qwen3-MoE under TP 2 x EP 2, its load-balancing losses on
  (transformers' and Megatron's, z-loss included), 3 updates: metrics (the losses counted once, not twice), the last
  step's gradients (Qwen3's q/k norms' too, summed over their heads on both ranks), the weights, the log-probs of a forward after the updates and the whole tensors the engine is
  handed (the experts gathered whole) equal the one-process run's; its DCP checkpoint after 2 updates resumes in one
  process exactly;
- 4 ranks: FSDP 2 x TP 2 x EP 2 (each rank's 2 experts sharded further over the 2 data-parallel ranks), 3 updates
  without the router losses (each data-parallel rank's would be its own micro-batches', as under plain FSDP):
  metrics, the last step's gradients, the weights and the engine's whole tensors equal one process;
- a dense Qwen3 decoder (per-head q/k norms) under TP 2, 2 updates: its gradients, the q/k norms' by name (each
  rank's norm sees its own heads: their gradients are summed over the group, `tensor_parallel.copy_to_group`);
- 4 ranks, TP 2 x EP 4 (the experts over both tensor-parallel groups, one whole expert a rank, each rank of a group
  dispatching half its group's rows): the float64 sparse layer, each group given tokens of its own (each rank's
  output and input gradient its group's rows of the one-process layer's, the experts' gradients the one-process
  ones); the actor, 3 updates: metrics, gradients, weights and the engine's whole tensors equal one process, and its
  checkpoint after 2 updates resumes in one process exactly;
- 4 ranks, TP 4 x EP 2 (two expert-parallel groups of 2 inside the tensor-parallel group, each expert on 2 ranks):
  the float64 sparse layer (outputs, input and router gradients whole on every rank, each expert's two partial
  gradients summing to the one-process one) and the actor over 3 updates equal one process;
- 4 ranks as one block of TP 2 x Ulysses 2 with EP 2 (over each tensor-parallel group) and EP 4 (over both), the
  load-balancing losses on: metrics (the losses too), gradients, weights, log-probs after 3 updates equal one
  process's; LoRA beside TP 2 x EP 4, without and with Ulysses 2, 2 updates: metrics, the adapters' gradients, the
  weights and the merged layers the engine receives equal one process's; a tiny Qwen3.5-MoE (linear attention, a
  shared expert) under TP 2 x EP 4 too (metrics, gradients and weights over 3 updates);
- a tiny GLM-4.5 (partial RoPE, q/k norms, group-limited sigmoid routing, a shared expert) under TP 2 x EP 2, 2
  updates: metrics, gradients, weights and the engine's whole tensors equal one process's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel

from lathe.config.plan import MeshPlan

from .test_expert_parallel import MEGATRON_LOSSES, PACKED, aux_moe, block_grads, moe_block, tiny_moe
from .test_parallel import COMPARED, LORA, SAVED_AFTER, STEPS, run_ranks, train
from .test_tensor_parallel_lora import tiny_qwen3

pytestmark = pytest.mark.slow

T = 2
KEYS = tuple(f"actor_rollout_ref.actor.fsdp_config.{k}_parallel_size={T}" for k in ("tensor", "expert"))
ROUTER_LOSSES = ("actor/router_aux_loss", "actor/load_balancing_loss", "actor/z_loss")


def rank_block() -> dict:
    """The float64 sparse layer with its experts over the group, every rank computing all the tokens."""
    from lathe.train import expert_parallel
    block, x, w = moe_block("qwen3_moe")
    ep = expert_parallel.expert_parallel(MeshPlan(1, 1, tp=T, ep=T), torch.device("cpu"))
    assert ep.same_tokens and ep.size == T
    expert_parallel.parallelize(block, ep)
    got = block_grads(block, x, w)
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in got.items()}


def tiny_glm():
    """A tiny GLM-4.5 in lathe's decoder (RoPE over half of each head, q/k norms and biases, group-limited sigmoid
    routing over 8 experts, a shared expert, layer 0 dense: models.glm_tiny)."""
    from models.glm_tiny import glm_model

    from lathe.models.hf import lathe_from_transformers
    return lathe_from_transformers(glm_model(seed=5))


def tp_ep_job(world: int, *, ckpt: str) -> dict:
    return {"block": rank_block(),
            "actor": train(world, -1, model_fn=aux_moe, overrides=(*KEYS, *MEGATRON_LOSSES), tp=T, log_probs=True,
                           grads=True, engine=True, save=ckpt),
            "dense": train(world, -1, steps=range(2), model_fn=tiny_qwen3, overrides=KEYS[:1], tp=T, grads=True),
            "glm": train(world, -1, steps=range(2), model_fn=tiny_glm, overrides=KEYS, tp=T, grads=True, engine=True)}


EP_OVER_GROUPS = (KEYS[0], f"actor_rollout_ref.actor.fsdp_config.expert_parallel_size={2 * T}")


def starved_block():
    """`moe_block`'s Qwen3-MoE layer whose router never picks expert 3 (positive tokens, its row of the router very
    negative): the rank that holds it receives no rows."""
    block, x, w = moe_block("qwen3_moe")
    with torch.no_grad():
        block.gate.weight[3] = -5.0
    return block, x.abs(), w


def groups_block(world: int, starved: bool = False) -> dict:
    """The float64 sparse layer with its experts over both tensor-parallel groups (TP 2 x EP 4), each group computing
    its own half of the tokens."""
    from lathe.train import expert_parallel
    block, x, w = starved_block() if starved else moe_block("qwen3_moe")
    plan = MeshPlan(1, world // T, tp=T, ep=world)
    ep = expert_parallel.expert_parallel(plan, torch.device("cpu"))
    assert not ep.same_tokens and ep.size == world and ep.tp.size == T
    expert_parallel.parallelize(block, ep)
    group = torch.distributed.get_rank() // T
    rows = slice(group * len(x) // 2, (group + 1) * len(x) // 2)
    got = block_grads(block, x[rows], w[rows])
    torch.distributed.all_reduce(got["gate.weight"])          # the router's gradient, each group's tokens' part:
    got["gate.weight"] /= T                                    # summed over the groups, counted once a group
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in got.items()}


def qwen3_5_moe():
    """A tiny Qwen3.5-MoE (gated-DeltaNet and full attention, 4 routed experts and a shared one: models.lathe_tiny)."""
    from models.lathe_tiny import hf_model

    from lathe.models.hf import lathe_from_transformers
    return lathe_from_transformers(hf_model("qwen3_5_moe_text", seed=3))


SP = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *PACKED)
# TP x EP beside Ulysses and LoRA: name -> (overrides, the one-process twin's, data-parallel group size, model)
COMPOSED = {"sp_ep2": ((*KEYS, *SP, *MEGATRON_LOSSES), (*PACKED, *MEGATRON_LOSSES), 2 * T, aux_moe),
            "sp_ep4": ((*EP_OVER_GROUPS, *SP, *MEGATRON_LOSSES), (*PACKED, *MEGATRON_LOSSES), 2 * T, aux_moe),
            "lora_ep4": ((*EP_OVER_GROUPS, *LORA), LORA, T, tiny_moe),
            "lora_sp_ep4": ((*EP_OVER_GROUPS, *LORA, *SP), (*LORA, *PACKED), 2 * T, tiny_moe),
            "qwen3_5_moe_ep4": (EP_OVER_GROUPS, (), T, qwen3_5_moe)}


def composed(world: int, name: str, one: bool = False) -> dict:
    keys, twin, group, model = COMPOSED[name]
    lora = "lora" in name
    return train(1 if one else world, -1, steps=range(2) if lora else range(STEPS), model_fn=model,
                 overrides=twin if one else keys, tp=1 if one else group, grads=True, engine=lora,
                 log_probs=not lora and group == 2 * T)     # (one data-parallel group of the 4 ranks)


def within_moe():
    """`tiny_moe` with as many key/value heads as query heads (4), which tensor parallelism of 4 cuts."""
    return tiny_moe(num_key_value_heads=4)


WITHIN = ("actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=4",
          "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2")


def within_block() -> dict:
    """The float64 sparse layer under TP 4 x EP 2: two expert-parallel groups of 2 inside the tensor-parallel group
    of 4 (every rank given all the tokens), each rank 2 of the 4 experts."""
    from lathe.train import expert_parallel
    block, x, w = moe_block("qwen3_moe")
    ep = expert_parallel.expert_parallel(MeshPlan(1, 1, tp=4, ep=2), torch.device("cpu"))
    assert not ep.same_tokens and ep.size == 2 and ep.tp.size == 4
    expert_parallel.parallelize(block, ep)
    got = block_grads(block, x, w)
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in got.items()}


def fsdp_job(world: int, *, ckpt: str) -> dict:
    return {"fsdp": train(world, -1, model_fn=tiny_moe, overrides=KEYS, tp=T, grads=True, engine=True),
            "groups_block": groups_block(world),
            "starved_block": groups_block(world, starved=True),
            "groups": train(world, -1, model_fn=tiny_moe, overrides=EP_OVER_GROUPS, tp=T, grads=True, engine=True,
                            save=ckpt),
            **{name: composed(world, name) for name in COMPOSED},
            "within_block": within_block(),
            "within": train(world, -1, model_fn=within_moe, overrides=WITHIN, tp=4, grads=True, engine=True)}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_tp_ep")
    return run_ranks(2 * T, root / "ranks", dict(ckpt=root / "ckpt"), fn=fsdp_job)[0], root / "ckpt"


@pytest.fixture(scope="module")
def one_moe():
    return train(1, -1, model_fn=tiny_moe, grads=True)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ep")
    return run_ranks(T, root / "ranks", dict(ckpt=root / "ckpt"), fn=tp_ep_job)[0], root / "ckpt"


@pytest.fixture(scope="module")
def ranks(checkpointed):
    return checkpointed[0]


@pytest.fixture(scope="module")
def one():
    return train(1, -1, model_fn=aux_moe, overrides=MEGATRON_LOSSES, log_probs=True, grads=True)


def test_sparse_layer_over_a_tensor_parallel_group_equals_one_process(ranks):
    block, x, w = moe_block("qwen3_moe")
    expected = block_grads(block, x, w)
    for r, got in enumerate(ranks):
        for name in ("out", "x", "gate.weight"):          # whole on every rank of the group
            assert_close_rel(got["block"][name], expected[name], 1e-12, name=f"rank {r}: {name}")
    for name in ("experts.gate_up_proj", "experts.down_proj"):     # rank r holds experts 2r, 2r + 1
        assert_close_rel(torch.cat([got["block"][name] for got in ranks]), expected[name], 1e-12, name=name)


def test_actor_tp_2_x_ep_2_updates_as_one_process(ranks, one):
    """3 updates with the load-balancing losses on: metrics, the last step's gradients, the weights, the log-probs
    after the updates and the engine's whole tensors; the experts are DTensors on the tp dim."""
    got = ranks[0]["actor"]
    assert got["experts_mesh"] == (("dp_shard", "tp"), (1, T))
    compared = (*COMPARED, *ROUTER_LOSSES)
    for a, b in zip(got["metrics"][:STEPS], one["metrics"][:STEPS], strict=True):
        assert a["actor/load_balancing_loss"] > 0
        assert_close_rel([a[k] for k in compared], [b[k] for k in compared], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    for name in one["grads"]:           # Qwen3's per-head q/k norms: each rank's heads' partial gradients summed
        if "_norm." in name and "self_attn" in name:
            assert_close_rel(got["grads"][name], one["grads"][name], rel=1e-5, name=name)
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for name in ("old_log_probs", "entropys"):
        assert_close_rel(got["metrics"][STEPS][name], one["metrics"][STEPS][name], rel=1e-5, name=name)
    assert any(".mlp.experts." in k for k in one["weights"])
    for rank in ranks:                                # every rank hands the engine the whole tensors
        assert_close_rel({k: rank["actor"]["engine"][k] for k in one["weights"]}, one["weights"], rel=1e-5,
                         name="engine weights")


def test_tp_x_ep_checkpoint_resumes_in_one_process(checkpointed, one):
    """The checkpoint after 2 updates (experts gathered whole, under their per-expert names) resumes in one process:
    its last update ends at the one-process run's weights."""
    _, ckpt = checkpointed
    resumed = train(1, -1, steps=range(SAVED_AFTER, STEPS), resume=ckpt, model_fn=aux_moe, overrides=MEGATRON_LOSSES)
    assert_close_rel(resumed["weights"], one["weights"], rel=1e-5, name="resumed weights")


def test_glm_4_5_under_tp_2_x_ep_2_updates_as_one_process(ranks):
    """GLM-4.5's layers cut over the group (heads with their partial RoPE and q/k norms, the dense and shared experts'
    columns, the routed experts placed 4 a rank, the router and its selection bias whole), 2 updates: metrics, the last
    step's gradients, the weights and the engine's whole tensors equal one process's."""
    one = train(1, -1, steps=range(2), model_fn=tiny_glm, grads=True, engine=True)
    got = ranks[0]["glm"]
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert {"model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.2.self_attn.k_norm.weight",
            "model.layers.1.mlp.experts.gate_up_proj"} <= set(one["grads"])
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for rank in ranks:      # (the sharded actor sends parameters; the selection bias, a buffer never trained, stays)
        sent = rank["glm"]["engine"]
        assert {k.rpartition(".")[2] for k in one["engine"].keys() - sent.keys()} == {"e_score_correction_bias"}
        assert_close_rel(sent, {k: one["engine"][k] for k in sent}, rel=1e-5, name="engine's whole tensors")


def test_dense_qwen3_q_k_norm_gradients_under_tp_2_equal_one_process(ranks):
    one = train(1, -1, steps=range(2), model_fn=tiny_qwen3, grads=True)
    got = ranks[0]["dense"]
    norms = [n for n in one["grads"] if "q_norm" in n or "k_norm" in n]
    assert norms
    for name in norms:
        assert_close_rel(got["grads"][name], one["grads"][name], rel=1e-5, name=name)
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")


def _equal_one_process(ranks: list, run: str, one: dict) -> None:
    got = ranks[0][run]
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for rank in ranks:
        assert_close_rel({k: rank[run]["engine"][k] for k in one["weights"]}, one["weights"], rel=1e-5,
                         name="engine weights")


def test_fsdp_2_x_tp_2_x_ep_2_updates_as_one_process(four, one_moe):
    ranks, _ = four
    assert ranks[0]["fsdp"]["experts_mesh"] == (("dp_shard", "tp"), (2, T))    # over tp, sharded over 2 dp ranks
    _equal_one_process(ranks, "fsdp", one_moe)


@pytest.mark.parametrize("run", ["groups_block", "starved_block"])
def test_sparse_layer_over_two_tensor_parallel_groups_equals_one_process(four, run):
    """Also where one rank's expert gets no rows (`starved_block`): that rank's backward took part in the collectives
    as the others' did (its empty expert run kept in the graph: `lathe.models.moe._looped`), where it hung before."""
    ranks, _ = four
    block, x, w = starved_block() if run == "starved_block" else moe_block("qwen3_moe")
    expected = block_grads(block, x, w)
    for r, got in enumerate(ranks):
        rows = slice(r // T * len(x) // 2, (r // T + 1) * len(x) // 2)
        for name in ("out", "x"):                       # the group's rows, whole on both of its ranks
            assert_close_rel(got[run][name], expected[name][rows], 1e-12, name=f"rank {r}: {name}")
        assert_close_rel(got[run]["gate.weight"], expected["gate.weight"], 1e-12, name="router")
    for name in ("experts.gate_up_proj", "experts.down_proj"):     # rank r holds expert r
        assert_close_rel(torch.cat([got[run][name] for got in ranks]), expected[name], 1e-12, name=name)
    if run == "starved_block":
        assert not ranks[3][run]["experts.down_proj"].any() and ranks[2][run]["experts.down_proj"].any()


def test_tp_2_x_ep_4_over_two_groups_updates_as_one_process(four, one_moe):
    """The experts over both tensor-parallel groups, one a rank (a DTensor on the flattened ep dim, FSDP's shard dim
    outside it of size 1), the dense weights cut over tp and sharded over the 2 data-parallel ranks."""
    ranks, _ = four
    assert ranks[0]["groups"]["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (1, 2 * T))
    assert ranks[0]["groups"]["mesh"][0] == (2, T)
    _equal_one_process(ranks, "groups", one_moe)


def test_tp_2_x_ep_4_checkpoint_resumes_in_one_process(four, one_moe):
    _, ckpt = four
    resumed = train(1, -1, steps=range(SAVED_AFTER, STEPS), resume=ckpt, model_fn=tiny_moe)
    assert_close_rel(resumed["weights"], one_moe["weights"], rel=1e-5, name="resumed weights")


@pytest.mark.parametrize("name", list(COMPOSED))
def test_tp_x_ep_beside_ulysses_and_lora_and_on_qwen3_5_moe_updates_as_one_process(four, name):
    ranks, _ = four
    got, one = ranks[0][name], composed(1, name, one=True)
    compared = (*COMPARED, *ROUTER_LOSSES) if name.startswith("sp") else COMPARED
    for a, b in zip(got["metrics"][:STEPS], one["metrics"][:STEPS], strict=True):
        assert_close_rel([a[k] for k in compared], [b[k] for k in compared], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    if "lora" in name:
        assert all("lora" in k for k in one["grads"]) and len(one["engine"]) < len(one["weights"])
        for rank in ranks:
            assert_close_rel({k: rank[name]["engine"][k] for k in one["engine"]}, one["engine"], rel=1e-5,
                             name="engine's merged layers")
    elif COMPOSED[name][2] == 2 * T:
        assert_close_rel(got["metrics"][STEPS]["old_log_probs"], one["metrics"][STEPS]["old_log_probs"], rel=1e-5,
                         name="log-probs")


def test_sparse_layer_over_two_expert_parallel_groups_inside_a_tensor_parallel_group_equals_one_process(four):
    """TP 4 x EP 2: every rank's output and input gradient are the whole layer's; ranks r and r + 2 hold the same 2
    experts, each with the gradient of the rows its group's shares sent it (rows 0-23 of the 48 sorted ones for
    ranks 0 and 1, 24-47 for 2 and 3), which sum to the one-process gradient."""
    ranks, _ = four
    block, x, w = moe_block("qwen3_moe")
    expected = block_grads(block, x, w)
    for r, got in enumerate(ranks):
        for name in ("out", "x", "gate.weight"):
            assert_close_rel(got["within_block"][name], expected[name], 1e-12, name=f"rank {r}: {name}")
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        summed = [ranks[r]["within_block"][name] + ranks[r + 2]["within_block"][name] for r in (0, 1)]
        assert_close_rel(torch.cat(summed), expected[name], 1e-12, name=name)


def test_tp_4_x_ep_2_inside_the_group_updates_as_one_process(four):
    ranks, _ = four
    one = train(1, -1, model_fn=within_moe, grads=True)
    assert ranks[0]["within"]["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (2, 2))
    _equal_one_process(ranks, "within", one)
