"""lathe.train.tensor_parallel and lathe.train.vocab_parallel: tensor parallelism equals the one-process computation.

Ranks are forks of one forkserver (gloo on the CPU), each run doing all its checks at once (a process group costs
seconds here):
- 2 ranks: the vocabulary-parallel log-probs, entropy and sum pi^2 (float64, values and gradients) against the whole
  vocabulary's; then a tiny decoder and value model (tied embeddings, q/k/v biases) cut over one group of 2: log-probs,
  entropy, sum pi^2, values and two PPO updates of actor and critic (SGD: a mis-scaled gradient shows) against one
  process (`test_ulysses`'s reference run);
- 4 ranks: the same with 2 groups of 2 (FSDP2 over 2 data-parallel ranks x TP 2), and the actor worker (AdamW, clipped
  gradients, gradient checkpointing) over 3 updates, saving its DCP checkpoint after 2, which then resumes in one
  process exactly (and a one-process checkpoint resumes under FSDP 2 x TP 2); the actor on HSDP x TP (2 replicas x
  1-way shards x TP 2, a 3-D mesh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_rel

from lathe.models.decoder import LatheCausalLM

from .test_parallel import COMPARED, SAVED_AFTER, STEPS, run_ranks, tiny_model
from .test_parallel import train as train_one
from .test_ulysses import COMMON, assert_same_run, learners, reference, share_run  # noqa: F401, F811  (a fixture)

pytestmark = pytest.mark.slow

T = 2
TP_KEYS = ["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size", "critic.model.fsdp_config.tensor_parallel_size"]
VOCAB, HIDDEN, TOKENS = 41, 16, 13    # the vocabulary cut unevenly (21 + 20 rows), as torch.chunk cuts it


# -- what each rank runs -------------------------------------------------------------------------------------------
def vocab_inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64),
            torch.randint(0, VOCAB, (TOKENS,), generator=g), torch.randn(2, TOKENS, generator=g, dtype=torch.float64))


def rank_vocab(group) -> dict:
    """This rank's vocabulary-parallel results (rows [r V/2, (r+1) V/2) of the weight), with and without entropy."""
    from lathe.train.vocab_parallel import vocab_parallel_token_stats
    hidden, weight, targets, w = vocab_inputs()
    rank = dist.get_rank(group)
    out = {}
    for entropy in (True, False):
        h, local = hidden.clone().requires_grad_(), weight.chunk(T)[rank].clone().requires_grad_()
        logp, ent, sq = vocab_parallel_token_stats(h, local, targets, group, vocab_size=VOCAB, temperature=0.7,
                                                   chunk_size=5, calculate_entropy=entropy,
                                                   calculate_sum_pi_squared=True)
        ((logp * w[0]).sum() + ((ent * w[1]).sum() if entropy else 0)).backward()
        out[entropy] = {"logp": logp.detach(), "entropy": None if ent is None else ent.detach(), "sum_sq": sq,
                        "grad_h": h.grad, "grad_w": local.grad}
    return out


def rank_learners(world: int, batches) -> dict:
    """Log-probs, values and two updates of each learner cut over groups of T (test_ulysses' `rank_run`)."""
    from lathe.config import load_config, run_plan
    from lathe.train import parallel
    from lathe.train.logprob import batched_token_stats
    from lathe.train.tensor_parallel import tensor_parallel
    cfg = load_config(None, [*COMMON, *(f"{k}={T}" for k in TP_KEYS), f"trainer.n_gpus_per_node={world}"])
    plan, dp, rank = run_plan(cfg), world // T, parallel.rank()
    assert (plan.actor.tensor_parallel_size, plan.actor.data_parallel_size, plan.mesh("critic").tp) == (T, dp, T)
    tp = tensor_parallel(plan.mesh("actor"), torch.device("cpu"))
    actor, critic = learners(cfg, plan, tp=tp, mesh=plan.mesh("actor"))

    def padded(batch) -> dict:              # the padded forward's hidden states through the same vocabulary split
        return {"padded": batched_token_stats(actor.model, batch, micro_batch_size=3, temperature=0.7,
                                              calculate_entropy=True, calculate_sum_pi_squared=True)}
    return {"sp_rank": tp.rank, **share_run(actor, critic, batches, dp, rank // T, max_tokens=16,
                                            before_updates=padded if world == T else None)}


def train_actor(world: int, *, steps=range(STEPS), save: Path | None = None, resume: Path | None = None) -> dict:
    """The actor worker's updates (AdamW, clipped, gradient checkpointing) under FSDP x TP T over `world` ranks."""
    return train_one(world, -1, steps=steps, save=save, resume=resume, tp=T, engine=True,
                     overrides=(f"{TP_KEYS[0]}={T}", "actor_rollout_ref.model.enable_gradient_checkpointing=true"))


def tp_job(world: int, *, root: str, ckpt: str | None = None, resume: str | None = None) -> dict:
    """Everything one rank checks (see the module docstring)."""
    from lathe.train.ulysses import consecutive_groups
    batches = torch.load(Path(root) / "batches.pt", weights_only=False)
    out = {"learners": rank_learners(world, batches)}
    if world == T:
        out["vocab"] = rank_vocab(consecutive_groups(T).group)
    if ckpt is not None:
        out["actor"] = train_actor(world, save=Path(ckpt))
    if resume is not None:
        out["resumed"] = train_actor(world, steps=range(SAVED_AFTER, STEPS), resume=Path(resume))
        # HSDP x TP: a 3-D mesh of 2 replicas x 1-way shards x TP 2
        out["hsdp"] = train_one(world, 1, steps=range(SAVED_AFTER), tp=T, overrides=(f"{TP_KEYS[0]}={T}",))
    return out


@pytest.fixture(scope="module")
def two_ranks(reference, tmp_path_factory):
    root = reference[0]
    return run_ranks(T, tmp_path_factory.mktemp("tp2"), dict(root=str(root)), fn=tp_job)[0]


@pytest.fixture(scope="module")
def four_ranks(reference, tmp_path_factory):
    root = reference[0]
    ckpt = tmp_path_factory.mktemp("tp_ckpt") / "actor"
    one = tmp_path_factory.mktemp("one_ckpt") / "actor"
    train_one(1, -1, steps=range(SAVED_AFTER), save=one)            # a one-process checkpoint, resumed under TP
    job = dict(root=str(root), ckpt=str(ckpt), resume=str(one))
    return run_ranks(2 * T, tmp_path_factory.mktemp("tp4"), job, fn=tp_job)[0], ckpt


# -- the checks ----------------------------------------------------------------------------------------------------
def test_vocab_parallel_stats_equal_the_whole_vocabulary(two_ranks):
    hidden, weight, targets, w = vocab_inputs()
    for entropy in (True, False):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp_all = torch.log_softmax(h @ wt.t() / 0.7, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        sum_sq = (2 * logp_all).exp().sum(-1)
        ((logp * w[0]).sum() + ((ent * w[1]).sum() if entropy else 0)).backward()
        got = [r["vocab"][entropy] for r in two_ranks]
        for r in got:
            assert_close_rel(r["logp"], logp.detach(), 1e-12, name="log-probs")
            assert_close_rel(r["sum_sq"], sum_sq.detach(), 1e-12, name="sum pi^2")
            assert_close_rel(r["grad_h"], h.grad, 1e-12, name="hidden gradient")
            if entropy:
                assert_close_rel(r["entropy"], ent.detach(), 1e-12, name="entropy")
        assert_close_rel(torch.cat([r["grad_w"] for r in got]), wt.grad, 1e-12, name="weight gradient")


def test_one_group_of_two_equals_one_process(two_ranks, reference):
    assert_same_run([{T: r["learners"]} for r in two_ranks], reference, T, T)
    rows = two_ranks[0]["learners"]["forward_rows"]
    mask = reference[1][0]["response_mask"][rows]          # the padded forward leaves padding positions unspecified
    for got, expected in zip(two_ranks[0]["learners"]["padded"], reference[2]["stats"]):     # use_remove_padding=false
        assert_close_rel(got * mask, expected[rows] * mask, 1e-5, name="padded forward")


def test_fsdp_2_x_tp_2_equals_one_process(four_ranks, reference):
    assert_same_run([{T: r["learners"]} for r in four_ranks[0]], reference, 2 * T, T)


def test_actor_worker_fsdp_2_x_tp_2_updates_as_one_process(four_ranks):
    ranks, _ = four_ranks
    got, one = ranks[0]["actor"], train_one(1, -1)
    assert got["mesh"][0] == (2, 2)            # rows cut over tp, the slices sharded over dp (a strided shard)
    for a, b in zip(got["metrics"], one["metrics"]):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for rank in ranks:                      # every rank hands the engine the whole tensors
        assert_close_rel({k: rank["actor"]["engine"][k] for k in one["weights"]}, one["weights"], rel=1e-5,
                         name="engine weights")


def test_hsdp_x_tp_updates_as_one_process(four_ranks):
    got, one = four_ranks[0][0]["hsdp"], train_one(1, -1, steps=range(SAVED_AFTER))
    assert got["mesh"][0] == (2, 1, 2)                    # dp_replicate x dp_shard x tp
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")


def test_tp_checkpoint_resumes_exactly_in_one_process_and_back(four_ranks):
    """Saved under FSDP 2 x TP 2 (DCP shards of 2-D DTensors), resumed in one process; and a one-process checkpoint
    resumed under FSDP 2 x TP 2: both end as the uninterrupted run."""
    ranks, ckpt = four_ranks
    one = train_one(1, -1)
    for resumed in (train_one(1, -1, steps=range(SAVED_AFTER, STEPS), resume=ckpt), ranks[0]["resumed"]):
        for a, b in zip(resumed["metrics"], one["metrics"][SAVED_AFTER:], strict=True):
            assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
        assert_close_rel(resumed["weights"], one["weights"], rel=1e-5, name="weights")


@pytest.mark.parametrize(("changes", "needle"), [
    (dict(num_attention_heads=6, num_key_value_heads=3), "3 key/value heads"),
    (dict(intermediate_size=63), "63 intermediate_size"),
])
def test_models_that_cannot_be_cut_are_refused(changes, needle):
    import dataclasses

    from lathe.train.tensor_parallel import check_model
    model = LatheCausalLM(dataclasses.replace(tiny_model().config, **changes))
    with pytest.raises(ValueError, match=needle) as err:
        check_model(model, 2, "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size")
    assert "Fix: set actor_rollout_ref.actor.fsdp_config.tensor_parallel_size to one of" in str(err.value)
    check_model(tiny_model(), 2, "k")       # 4 heads, 2 key/value heads, 64 columns: fine
    check_model(LatheCausalLM(dataclasses.replace(tiny_model().config, vocab_size=41)), 2, "k")   # cut unevenly
    with pytest.raises(ValueError, match="lathe's text decoder"):
        check_model(torch.nn.Linear(2, 2), 2, "k")


def test_mixture_of_experts_models_are_refused_without_expert_parallelism_a_multiple_of_the_size():
    from models.lathe_tiny import MOE, hf_config

    from lathe.models.config import LatheConfig
    from lathe.train.tensor_parallel import check_model
    model = LatheCausalLM(LatheConfig.from_hf_dict(hf_config(MOE).to_dict()))
    key = "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size"
    ep_key = "actor_rollout_ref.actor.fsdp_config.expert_parallel_size"
    for ep in (1, 3):
        with pytest.raises(ValueError, match=rf"mixture-of-experts layers .*\({ep_key}={ep}\)\. Fix: set {ep_key}=2 "
                                             rf"\(or a multiple or divisor\), or {key}=1"):
            check_model(model, 2, key, ep)
    check_model(model, 2, key, 2)                      # TP x EP: the experts over the group
    check_model(model, 2, key, 4)                      # over two whole groups
    with pytest.raises(ValueError, match=rf"\({ep_key}=3\)"):
        check_model(model, 4, key, 3)                  # neither a multiple nor a divisor
    from models.gpt_oss_tiny import gpt_oss_config
    gpt_oss = LatheCausalLM(LatheConfig.from_hf_dict(gpt_oss_config().to_dict()))
    with pytest.raises(ValueError, match="only Qwen3-MoE's, Qwen3.5-MoE's, Qwen3-Next's and GLM-4.5's .* are cut "
                                         "over a tensor-parallel group"):
        check_model(gpt_oss, 2, key, 2)


def test_the_driver_checks_the_decoder_the_workers_will_run():
    """A built-in model (or one loaded with model.override_config) reaches the driver as a transformers module that
    the workers turn into lathe's decoder (impl=auto); the driver's check takes it as that decoder, and refuses it
    only where the workers would keep transformers (impl=hf). It once refused every TP run of a built-in model."""
    from lathe.config import load_config, run_plan
    from lathe.data.builtin import builtin_tokenizer
    from lathe.loop.setup import check_parallel_model
    from lathe.models.hf import build_builtin_model
    cfg = load_config(None, ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2"])
    plan, model = run_plan(cfg, 2), build_builtin_model("tiny", vocab_size=len(builtin_tokenizer()))
    check_parallel_model(plan, model)
    with pytest.raises(ValueError, match="lathe's text decoder .* runs Qwen2ForCausalLM"):
        check_parallel_model(plan, model, impl="hf")
