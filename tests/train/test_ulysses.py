"""lathe.train.ulysses: Ulysses sequence parallelism equals the one-process computation.

Ranks are processes (torch.multiprocessing, gloo on the CPU) sharing each micro-batch's packed stream: the attention
over 2 ranks against `PackedAttention` in one process (outputs and gradients, float64), then a tiny lathe decoder
sharded with FSDP2 on 2 ranks (one sequence-parallel group) and on 4 (2 groups of 2: data-parallel x sequence-
parallel): log-probs, entropy and sum pi^2, a critic's values, and PPO updates (SGD, so a mis-scaled gradient shows)
against the same in one process. Each spawn runs all its checks at once (a process start costs seconds here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import assert_close_rel, free_port, gloo_rank, run_processes

from lathe.batch import Batch
from lathe.models.attention import PackedAttention
from lathe.models.config import LatheConfig as ModelConfig
from lathe.models.config import RopeConfig
from lathe.models.decoder import LatheCausalLM, LatheValueModel, init_weights
from lathe.train.ulysses import check_model, local_slice, padded_length

VOCAB, PAD, S = 40, 0, 2
REL = 1e-5
JOIN_S = 120
LENGTHS = [5, 1, 8, 3]                 # a packed stream of 17 tokens: padded to 18 over 2 ranks
HEADS = [(4, 2), (4, 1)]               # (query heads, key/value heads): split, and repeated over the ranks
COMMON = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.entropy_coeff=0.01",
          "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.grad_clip=1000.0",
          "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.model.use_remove_padding=true",
          "data.max_prompt_length=5", "data.max_response_length=6", "algorithm.adv_estimator=gae",
          "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1", "critic.grad_clip=1000.0",
          "critic.model.use_remove_padding=true"]
SP = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"]


def model_config(heads: int = 4, kv: int = 2, rope: str = "default") -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv, head_dim=8,
                       max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True,
                       rope=RopeConfig(rope_type=rope, factor=2.0 if rope == "dynamic" else None))


def tiny(seed: int, value: bool = False):
    """A tiny lathe decoder (or value model), fp32, seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LatheValueModel(model_config()) if value else LatheCausalLM(model_config())
        init_weights(model, std=0.2)
    return model


def rollout_batch(rows: int, seed: int) -> Batch:
    from lathe.generation import RolloutOutput
    from lathe.rollout.base import to_batch
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    return to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * rows), PAD, n=1)


def ppo_batches(policy, critic) -> list[Batch]:
    """Two steps' batches with old log-probs and values (perturbed), advantages, returns and reference log-probs."""
    from lathe.train.critic import response_values
    from lathe.train.logprob import response_log_probs
    out = []
    for step in range(2):
        batch = rollout_batch(8, seed=step)
        g = torch.Generator().manual_seed(100 + step)
        mask = batch["response_mask"].float()
        with torch.no_grad():
            logp, _ = response_log_probs(policy.eval(), batch, temperature=0.7, remove_padding=True)
            values = response_values(critic.eval(), batch, remove_padding=True)
        noise = lambda scale: scale * torch.randn(mask.shape, generator=g)   # noqa: E731
        batch["old_log_probs"] = (logp + noise(0.3)) * mask
        batch["ref_log_prob"] = (logp + noise(0.5)) * mask
        batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
        batch["values"] = (values + noise(0.5)) * mask
        batch["returns"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
        out.append(batch)
    return out


def learners(cfg, plan, sp=None, device_count: int = 1, *, tp=None, mesh=None):
    """(PPOActor, PPOCritic) on fresh tiny models with SGD at a constant lr (an update is then its gradient, scale
    included); sharded with FSDP2 in a rank of a group (on `mesh`, a `MeshPlan`, after cutting the models over the
    tensor-parallel group `tp`)."""
    from lathe.train import parallel, tensor_parallel
    from lathe.train.actor import PPOActor
    from lathe.train.critic import PPOCritic
    out = []
    for model, group, make in ((tiny(0), cfg.actor_rollout_ref.actor, PPOActor), (tiny(1, value=True), cfg.critic,
                                                                                   PPOCritic)):
        if parallel.in_group():
            tensor_parallel.parallelize(model, tp)
            parallel.shard_model(model, device=torch.device("cpu"), mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        if make is PPOActor:
            out.append(PPOActor(model, opt, sched, group, mini_batch_size=plan.actor.mini_batch_sequences_per_device,
                                temperature=0.7, max_response_length=6, use_remove_padding=True, sp=sp, tp=tp))
        else:
            out.append(PPOCritic(model, opt, sched, group, mini_batch_size=plan.critic.mini_batch_sequences_per_device,
                                 max_response_length=6, use_remove_padding=True, sp=sp, tp=tp))
    return out


def forwards(actor, critic, batch: Batch, sp=None, max_tokens: int = 8) -> dict:
    """Log-probs, entropy and sum pi^2 (micro-batches packed by a token budget), and the critic's values."""
    from lathe.train.logprob import batched_token_stats
    stats = batched_token_stats(actor.model, batch, micro_batch_size=2, temperature=0.7, calculate_entropy=True,
                                calculate_sum_pi_squared=True, remove_padding=True, max_tokens=max_tokens, sp=sp)
    return {"stats": stats, "values": critic.compute_values(batch)["values"]}


# -- in each rank ---------------------------------------------------------------------------------------------------
def attention_inputs(heads: int, kv: int):
    g = torch.Generator().manual_seed(heads * 10 + kv)
    T = sum(LENGTHS)
    q, k, v, w = (torch.randn(T, h, 8, generator=g, dtype=torch.float64) for h in (heads, kv, kv, heads))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, w, cu


def rank_attention(sp) -> dict:
    """For each head layout: this rank's slice through `UlyssesAttention`, the whole output gathered, and the
    gradient of sum(out * w) for this rank's q, k, v slices."""
    from lathe.train.ulysses import UlyssesAttention, gather_tokens
    out = {}
    for heads, kv in HEADS:
        q, k, v, w, cu = attention_inputs(heads, kv)
        T = q.shape[0]
        total = padded_length(T, sp.size)
        bounds = torch.cat([cu, torch.tensor([total], dtype=torch.int32)])
        mine = [local_slice(x, sp).detach().requires_grad_() for x in (q, k, v)]
        attn = UlyssesAttention(PackedAttention(bounds, max(LENGTHS)), sp)
        whole = gather_tokens(attn(*mine), sp)[:T]
        (whole * w).sum().backward()
        out[(heads, kv)] = {"out": whole.detach(), "grads": [x.grad for x in mine]}
    return out


def share_run(actor, critic, batches: list[Batch], dp: int, share: int, sp=None, *, max_tokens: int = 8,
              before_updates=None) -> dict:
    """What `assert_same_run` compares, for the data-parallel `share` of `dp` this rank's group holds: the rows of
    the first batch it runs forward, their log-probs, entropy, sum pi^2 and values (`forwards`), the two updates'
    metrics and the full weights after them. `before_updates(batch)`: more results on that share, taken first."""
    from lathe.cluster.dispatch import even_shares, update_shares
    from lathe.train import parallel
    res = {"forward_rows": even_shares(batches[0], dp, balance=True)[share]}
    batch = batches[0].select(res["forward_rows"])
    res["forwards"] = forwards(actor, critic, batch, sp, max_tokens=max_tokens)
    res.update(before_updates(batch) if before_updates is not None else {})
    rows = [update_shares(b, dp, mini_batch_size=4, balance=False)[share] for b in batches]
    res["updates"] = [(actor.update_policy(b.select(r)), critic.update_critic(b.select(r)))
                      for b, r in zip(batches, rows)]
    res["weights"] = {name: {k: t.clone() for k, t in parallel.full_tensors(m.model)}
                      for name, m in (("actor", actor), ("critic", critic))}
    return res


def rank_run(rank: int, world: int, size: int, batches: list[Batch]) -> dict:
    """Log-probs, values and two updates of each learner with sequence-parallel `size` over this `world`."""
    from lathe.config import load_config, run_plan
    from lathe.train.ulysses import sequence_parallel
    sp, dp = sequence_parallel(size), world // size
    cfg = load_config(None, [*COMMON, *(f"{k}={size}" for k in SP), f"trainer.n_gpus_per_node={world}"])
    plan = run_plan(cfg)
    assert (plan.actor.sequence_parallel_size, plan.actor.data_parallel_size) == (size, dp)
    actor, critic = learners(cfg, plan, sp)
    return {"sp_rank": sp.rank, **share_run(actor, critic, batches, dp, rank // size, sp)}


def rank_main(rank: int, world: int, port: int, root: str, queue) -> None:
    """2 ranks: the attention, and one group of 2; 4 ranks: 2 groups of 2, and one group of 4 (key/value heads
    repeated in the model)."""
    def work():
        from lathe.train.ulysses import sequence_parallel
        res = {"attention": rank_attention(sequence_parallel(S))} if world == S else {}
        batches = torch.load(Path(root) / "batches.pt", weights_only=False)
        for size in (S, world) if world > S else (S,):
            res[size] = rank_run(rank, world, size, batches)
        torch.save(res, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, world, port, queue, work, JOIN_S)


def spawn(world: int, root: Path) -> list[dict]:
    ctx = mp.get_context("forkserver")      # one server imports torch and lathe once; each rank is a fork of it
    ctx.set_forkserver_preload([__name__, "lathe.config", "lathe.train.actor", "lathe.train.critic",
                                "lathe.cluster.dispatch", "torch.distributed.fsdp"])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(root), queue), daemon=True)
             for r in range(world)]
    run_processes(procs, queue, JOIN_S)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(world)]


# -- the one process, and the comparisons -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The inputs (saved for the ranks) and the one-process results."""
    from lathe.config import load_config, run_plan
    from lathe.train.logprob import response_token_stats
    root = tmp_path_factory.mktemp("ulysses")
    batches = ppo_batches(tiny(0), tiny(1, value=True))
    torch.save(batches, root / "batches.pt")
    cfg = load_config(None, COMMON)
    actor, critic = learners(cfg, run_plan(cfg))
    with torch.no_grad():
        stats = response_token_stats(actor.model.eval(), batches[0], temperature=0.7, calculate_entropy=True,
                                     calculate_sum_pi_squared=True, remove_padding=True)
    res = {"stats": stats, "values": critic.compute_values(batches[0])["values"]}
    res["updates"] = [(actor.update_policy(b), critic.update_critic(b)) for b in batches]
    res["weights"] = {"actor": dict(actor.model.named_parameters()), "critic": dict(critic.model.named_parameters())}
    return root, batches, res


@pytest.fixture(scope="module")
def two_ranks(reference):
    return spawn(S, reference[0])


@pytest.fixture(scope="module")
def four_ranks(reference):
    return spawn(2 * S, reference[0])


def test_ulysses_attention_equals_packed_attention(two_ranks):
    """Outputs and the gradients of q, k, v (key/value heads split, and repeated when fewer than the ranks)."""
    for heads, kv in HEADS:
        q, k, v, w, cu = attention_inputs(heads, kv)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = PackedAttention(cu, max(LENGTHS))(q, k, v)
        (out * w).sum().backward()
        for rank in two_ranks:
            got = rank["attention"][(heads, kv)]
            assert_close_rel(got["out"], out.detach(), 1e-12, name=f"output {heads}/{kv} heads")
        for i, want in enumerate((q.grad, k.grad, v.grad)):
            got = torch.cat([rank["attention"][(heads, kv)]["grads"][i] for rank in two_ranks])[:len(want)]
            assert_close_rel(got, want, 1e-12, name=f"gradient {'qkv'[i]}, {heads}/{kv} heads")


def assert_same_run(ranks: list[dict], reference, world: int, size: int) -> None:
    _, batches, want = reference
    ranks = [r[size] for r in ranks]
    assert [r["sp_rank"] for r in ranks] == [r % size for r in range(world)]
    stats = [torch.zeros_like(x) for x in want["stats"]]
    values = torch.zeros_like(want["values"])
    for group in range(world // size):
        first = ranks[group * size]
        for member in ranks[group * size:(group + 1) * size]:       # a group's ranks answer alike
            for a, b in zip(member["forwards"]["stats"], first["forwards"]["stats"]):
                assert torch.equal(a, b)
        rows = first["forward_rows"]
        for x, got in zip(stats, first["forwards"]["stats"]):
            x[rows] = got
        values[rows] = first["forwards"]["values"]
    where = f"{world // size} group(s) of {size} ranks"
    for name, got, expected in zip(("log-probs", "entropy", "sum pi^2"), stats, want["stats"]):
        assert_close_rel(got, expected, REL, name=f"{name}, {where}")
    assert_close_rel(values, want["values"], REL, name=f"values, {where}")
    for step, ((actor, critic), (want_actor, want_critic)) in enumerate(zip(ranks[0]["updates"], want["updates"])):
        for got, expected in ((actor, want_actor), (critic, want_critic)):
            assert set(got) == set(expected)
            assert_close_rel({k: torch.tensor(v) for k, v in got.items()},
                             {k: torch.tensor(v) for k, v in expected.items()}, REL, name=f"step {step}, {where}")
    for name in ("actor", "critic"):
        expected = want["weights"][name]
        for rank in (ranks[0], ranks[-1]):
            got = {k: rank["weights"][name][k] for k in expected}     # (the sharded model also names tied weights)
            assert_close_rel(got, expected, REL, name=f"{name} weights, {where}")


def test_one_group_of_two_ranks_equals_one_process(two_ranks, reference):
    assert_same_run(two_ranks, reference, S, S)


def test_two_groups_of_two_ranks_equal_one_process(four_ranks, reference):
    assert_same_run(four_ranks, reference, 2 * S, S)


def test_one_group_of_four_ranks_equals_one_process(four_ranks, reference):
    """4 ranks over the model's 2 key/value heads: each is repeated to 4 before the all-to-all."""
    assert_same_run(four_ranks, reference, 2 * S, 2 * S)


# -- one process ----------------------------------------------------------------------------------------------------
def test_padding_and_slices():
    class Place:
        size, rank = 2, 1
    assert [padded_length(t, 4) for t in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert local_slice(torch.arange(5), Place(), fill=-1).tolist() == [3, 4, -1]
    assert local_slice(torch.arange(6).view(3, 2), Place()).tolist() == [[4, 5], [0, 0]]


@pytest.mark.parametrize("heads, kv, size, ok", [(4, 2, 2, True), (4, 1, 2, True), (4, 1, 4, True), (8, 2, 4, True),
                                                 (8, 4, 8, True), (4, 2, 3, False), (6, 3, 2, False), (4, 4, 8, False)])
def test_heads_must_split_over_the_group(heads, kv, size, ok):
    with torch.device("meta"):
        model = LatheCausalLM(model_config(heads, kv))
    if ok:
        check_model(model, size, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
        return
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}: the "
                                         rf"model's {heads} query heads and {kv} key/value heads"):
        check_model(model, size, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")


def test_models_that_cannot_split_are_refused():
    key = "critic.ulysses_sequence_parallel_size"
    with torch.device("meta"):
        dynamic = LatheCausalLM(model_config(rope="dynamic"))
    with pytest.raises(ValueError, match=rf"{key}=2: dynamic NTK RoPE"):
        check_model(dynamic, 2, key)
    with pytest.raises(ValueError, match=rf"{key}=2 needs lathe's text decoder .* this role runs Linear"):
        check_model(torch.nn.Linear(2, 2), 2, key)
    check_model(torch.nn.Linear(2, 2), 1, key)            # size 1: anything runs
