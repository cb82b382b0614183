"""lathe.train.expert_parallel: expert parallelism equals the one-process computation.

One group of 4 gloo ranks (forks of one forkserver, as `test_parallel`'s), all checks in it:
- a Qwen3-MoE sparse layer in float64 with its 4 experts over 4 ranks (one expert each): each rank's output and
  input gradient are its rows of the one-process layer's, and the weight gradients (the router's summed over the
  ranks, each rank's expert whole) the one-process ones;
- the same for a GPT-OSS sparse layer (router and expert biases, clamped SwiGLU);
- the actor worker (AdamW, clipped gradients) on a tiny Qwen3-MoE, 3 updates, on FSDP over 4 ranks x EP 2 (each
  rank 2 experts whole, sharded over the 2 groups) saving its checkpoint after 2 and handing the engine whole
  tensors; on HSDP 2 replicas x EP 2 (two EP=2 groups, the experts not sharded further); and resuming a one-process
  checkpoint on FSDP 4 x EP 2: metrics and weights equal the one-process run, and the EP checkpoint resumes exactly
  in one process, with the experts under their per-expert Hugging Face names;
- the same actor with its load-balancing losses on (transformers' and Megatron's, z-loss included), on EP 2 x
  Ulysses 2: metrics (the losses too), the last step's
  gradients, the weights and the log-probs of a forward after the updates equal the one-process run's;
- the same losses on mini-batches of 5 sequences over the 4 ranks, padded with ghost rows (packed under EP 2, padded,
  packed under EP 2 x Ulysses 2): the one-process run that cuts the same micro-batches without ghost rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_rel
from safetensors import safe_open
# the ranks' sparse layers read these transformers configs (models.deepseek_tiny, models.gpt_oss_tiny): imported
# here, so the forkserver that preloads this module imports transformers once, not each of the 4 ranks
from transformers import DeepseekV3Config, GptOssConfig  # noqa: F401

from lathe.config.plan import MeshPlan
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights

from .conftest import VOCAB
from .test_parallel import COMPARED, SAVED_AFTER, STEPS, run_ranks, train

pytestmark = pytest.mark.slow

EP_KEY = "actor_rollout_ref.actor.fsdp_config.expert_parallel_size"
TOKENS, HIDDEN = 24, 16
FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
ROUTERS = ("gate.weight", "router.weight", "router.bias")


def moe_config(**changes) -> LatheConfig:
    """Qwen3-MoE, 2 sparse layers of 4 experts, top-2."""
    return LatheConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 64, "tie_word_embeddings": False, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [], "norm_topk_prob": True,
        "decoder_sparse_step": 1, **changes})


def tiny_moe(**changes) -> LatheCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LatheCausalLM(moe_config(**changes))
        init_weights(model, std=0.2)
    return model


def aux_moe() -> LatheCausalLM:
    """`tiny_moe` whose update adds the routers' load-balancing loss, weighted to show in the gradients."""
    return tiny_moe(output_router_logits=True, router_aux_loss_coef=0.5)


# EP 2 x Ulysses 2 on 4 ranks: 2 sequence-parallel groups of 2, each group's 2 ranks one EP group too. The load-
# balancing loss is each micro-batch's (as transformers' per forward): the one-process twin cuts the same micro-batches
PACKED = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
SP = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *PACKED)
# Megatron's router losses beside transformers' in the EP x Ulysses run and its twin: their per-layer statistics are
# summed over the sequence-parallel group too (`ulysses.router_layer_totals`)
MEGATRON_LOSSES = ("actor_rollout_ref.actor.moe_aux_loss_coeff=0.3", "actor_rollout_ref.actor.moe_z_loss_coeff=0.01")
# 2 prompts x n=5 a step, mini-batches of 5 sequences over 4 ranks: shares [0, 1], [2, 3], [4, ghost], [ghost, ghost]
# (lathe.cluster.dispatch), one micro-batch each; over 2 sequence-parallel groups [0, 1, 2], [3, 4, ghost]. The router
# losses leave the ghost rows' tokens out (lathe.train.router_tokens): the one-process twins cut 2 + 2 + 1 (3 + 2)
GHOST_MOE = ("data.train_batch_size=2", "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
             *MEGATRON_LOSSES)
REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding=true"
GHOST_RUNS = {"ghosts_packed_ep": (dict(overrides=(f"{EP_KEY}=2", *GHOST_MOE, REMOVE_PADDING)), 2),
              "ghosts_padded": (dict(overrides=GHOST_MOE), 2),
              "ghosts_ep_x_ulysses": (dict(overrides=(f"{EP_KEY}=2", *GHOST_MOE, REMOVE_PADDING,
                                                      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"),
                                           tp=2), 3)}


def moe_block(family: str):
    """A float64 sparse layer of `family` (qwen3_moe, gpt_oss, deepseek_v3) and its inputs: tokens, output weights."""
    from models.deepseek_tiny import deepseek_config
    from models.gpt_oss_tiny import gpt_oss_config

    from lathe.models.deepseek import DeepseekMoeBlock
    from lathe.models.gpt_oss import GptOssMoeBlock
    from lathe.models.moe import SparseMoeBlock
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if family == "qwen3_moe":
            block = SparseMoeBlock(moe_config(hidden_size=HIDDEN))
        elif family == "gpt_oss":
            block = GptOssMoeBlock(LatheConfig.from_hf_dict(gpt_oss_config(hidden_size=HIDDEN).to_dict()))
        else:                     # 8 experts in 4 groups, a shared expert (its gradient: each rank's tokens only)
            block = DeepseekMoeBlock(LatheConfig.from_hf_dict(deepseek_config(hidden_size=HIDDEN).to_dict()))
        block = block.double()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        return block, torch.randn(TOKENS, HIDDEN, dtype=torch.float64), torch.randn(TOKENS, HIDDEN,
                                                                                   dtype=torch.float64)


def block_grads(block, x, w) -> dict:
    x = x.clone().requires_grad_()
    out = block(x)
    (out * w).sum().backward()
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


def rank_block(world: int, family: str) -> dict:
    """This rank's rows of the sparse layer with its experts over all `world` ranks (one expert each)."""
    from lathe.train import expert_parallel
    block, x, w = moe_block(family)
    ep = expert_parallel.expert_parallel(MeshPlan(1, world, ep=world), torch.device("cpu"))
    expert_parallel.parallelize(block, ep)
    rows = slice(ep.rank * TOKENS // world, (ep.rank + 1) * TOKENS // world)
    got = block_grads(block, x[rows], w[rows])
    for name in ROUTERS:                                 # the router's gradient: a sum over every rank's tokens
        if name in got:
            dist.all_reduce(got[name])
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in got.items()}


def ep_job(world: int, *, ckpt: str, one: str) -> dict:
    """Everything one rank checks (see the module docstring)."""
    ep = (f"{EP_KEY}=2",)
    return {"block": {family: rank_block(world, family) for family in FAMILIES},
            "fsdp": train(world, -1, save=ckpt, model_fn=tiny_moe, engine=True, overrides=ep),
            "hsdp": train(world, 2, model_fn=tiny_moe, overrides=ep),
            "resumed": train(world, -1, steps=range(SAVED_AFTER, STEPS), resume=one, model_fn=tiny_moe, overrides=ep),
            "sp": train(world, -1, model_fn=aux_moe, overrides=(*ep, *SP, *MEGATRON_LOSSES), tp=2, log_probs=True,
                        grads=True),
            **{name: train(world, -1, model_fn=aux_moe, steps=range(2), grads=True, **job)
               for name, (job, _) in GHOST_RUNS.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    one = train(1, -1, model_fn=tiny_moe)
    train(1, -1, steps=range(SAVED_AFTER), save=root / "one", model_fn=tiny_moe)     # resumed under FSDP x EP
    [ranks] = run_ranks(4, root / "ranks", dict(ckpt=root / "ep", one=root / "one"), fn=ep_job)
    return root, one, ranks


@pytest.fixture(scope="module")
def one_with_aux():
    """The EP x Ulysses run's one-process twin: packed, the load-balancing loss on."""
    return train(1, -1, model_fn=aux_moe, overrides=(*PACKED, *MEGATRON_LOSSES), log_probs=True, grads=True)


@pytest.mark.parametrize("name", list(GHOST_RUNS))
def test_ghost_rows_beside_router_losses_update_as_one_process(runs, name):
    """Mini-batches of 5 over 4 ranks (ghost rows on two of them, one beside a real row) with the load-balancing
    losses on (transformers', Megatron's and its z-loss): the metrics, the last step's gradients and the weights of
    the one-process run that cuts the same micro-batches without ghost rows; packed under EP 2, padded, and packed
    under EP 2 x Ulysses 2."""
    _, _, ranks = runs
    job, micro = GHOST_RUNS[name]
    one = train(1, -1, model_fn=aux_moe, steps=range(2), grads=True, micro=micro,
                overrides=tuple(o for o in job["overrides"] if "parallel_size" not in o))
    compared = (*COMPARED, "actor/router_aux_loss", "actor/load_balancing_loss", "actor/z_loss")
    got = ranks[0][name]
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in compared], [b[k] for k in compared], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")


def assert_same(got: dict, expected: dict, steps=range(STEPS)) -> None:
    assert len(got["metrics"]) == len(steps)
    for a, b in zip(got["metrics"], [expected["metrics"][s] for s in steps]):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(got["weights"], expected["weights"], rel=1e-5, name="weights")


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_layer_over_four_ranks_equals_one_process(runs, family):
    _, _, ranks = runs
    block, x, w = moe_block(family)
    expected = block_grads(block, x, w)
    got = [r["block"][family] for r in ranks]
    rel = 1e-6 if family == "deepseek_v3" else 1e-12      # DeepSeek's router scores in float32 (as transformers')
    for name in ("out", "x"):
        assert_close_rel(torch.cat([r[name] for r in got]), expected[name], rel, name=name)
    for name in expected:
        if name in ROUTERS:
            assert_close_rel(got[0][name], expected[name], rel, name=f"router gradient {name}")
        elif name.startswith("experts."):                            # rank r holds experts r*E/4 ...
            assert_close_rel(torch.cat([r[name] for r in got]), expected[name], rel, name=name)


def test_fsdp_4_x_ep_2_updates_as_one_process(runs):
    _, one, ranks = runs
    got = ranks[0]["fsdp"]
    assert got["mesh"][0] == (4,)                     # the other weights: FSDP over all 4 ranks
    assert got["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (2, 2))     # experts: over 2 groups x EP 2
    assert_same(got, one)
    assert any(".mlp.experts." in k for k in one["weights"])
    for rank in ranks:                                # every rank hands the engine the whole tensors
        assert_close_rel({k: rank["fsdp"]["engine"][k] for k in one["weights"]}, one["weights"], rel=1e-5,
                         name="engine weights")


def test_hsdp_2_x_ep_2_updates_as_one_process(runs):
    """Each replica is one EP=2 group: its 2 ranks hold 2 experts each, whole."""
    _, one, ranks = runs
    assert ranks[0]["hsdp"]["experts_mesh"] == (("dp_replicate", "dp_shard_mod_ep", "ep"), (2, 1, 2))
    assert_same(ranks[0]["hsdp"], one)


def test_ep_2_x_ulysses_2_updates_as_one_process(runs, one_with_aux):
    """Each rank dispatches the tokens of its slice of the packed stream; the load-balancing losses (transformers'
    and Megatron's, with its z-loss) are the whole micro-batch's (their statistics summed over the sequence-parallel
    group, the padding left out)."""
    _, _, ranks = runs
    got, one = ranks[0]["sp"], one_with_aux
    assert got["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (2, 2))
    compared = (*COMPARED, "actor/router_aux_loss", "actor/load_balancing_loss", "actor/z_loss")
    for a, b in zip(got["metrics"][:STEPS], one["metrics"][:STEPS]):
        assert_close_rel([a[k] for k in compared], [b[k] for k in compared], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for name in ("old_log_probs", "entropys"):         # each rank's share of a forward after the updates
        mine = torch.cat([r["sp"]["metrics"][STEPS][name] for r in ranks[::2]])
        assert_close_rel(mine, one["metrics"][STEPS][name], rel=1e-5, name=name)


def test_ep_checkpoints_resume_in_one_process_and_back(runs):
    root, one, ranks = runs
    assert_same(ranks[0]["resumed"], one, steps=range(SAVED_AFTER, STEPS))   # one process -> FSDP 4 x EP 2
    resumed = train(1, -1, steps=range(SAVED_AFTER, STEPS), resume=root / "ep", model_fn=tiny_moe)
    assert_same(resumed, one, steps=range(SAVED_AFTER, STEPS))               # FSDP 4 x EP 2 -> one process
    names = set()
    for f in (root / "ep" / "huggingface").glob("*.safetensors"):
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    assert {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)


def test_models_whose_experts_cannot_be_placed_are_refused():
    """Experts that cannot be cut are refused; LoRA beside them is not, but a LoRA target on them is."""
    from lathe.models.lora import apply_lora
    from lathe.train.expert_parallel import check_model

    from .test_parallel import tiny_model
    check_model(tiny_moe(), 4, "k")                                      # 4 experts: 1 per rank
    with pytest.raises(ValueError, match=r"no mixture-of-experts layers .* Fix: set k=1"):
        check_model(tiny_model(), 2, "k")                                # a dense model
    with pytest.raises(ValueError, match=r"4 experts, which 3 does not divide. Fix: set k to one of \[1, 2, 4\]"):
        check_model(tiny_moe(), 3, "k")
    lora = tiny_moe()            # adapters on the attention only: the routed experts stay frozen and can be cut
    apply_lora(lora, rank=2, alpha=4, target_modules="all-linear", exclude_modules=None, dropout=0.0, seed=0)
    check_model(lora, 2, "k")
    with pytest.raises(ValueError, match=r"\['experts'\] name\(s\) the routed experts' grouped weights.* Fix: "):
        apply_lora(tiny_moe(), rank=2, alpha=4, target_modules=["q_proj", "experts"])
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\] name\(s\) the routed experts"):
        apply_lora(tiny_moe(), rank=2, alpha=4, target_modules="gate_up_proj")
