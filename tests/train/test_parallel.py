"""lathe.train.parallel's hybrid sharding (HSDP: verl's `fsdp_config.fsdp_size` smaller than the world): the actor
on a 2 x 2 mesh of 4 gloo ranks (2 replicas of 2-way shards) updates exactly as one process does (LoRA adapters
too), and the sharded checkpoint it writes resumes exactly in one process and on plain FSDP over 2 ranks.

The ranks are forks of one forkserver that imported torch and lathe once (a spawn per rank would import them
four times over on a small machine)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel, free_port, gloo_rank, run_processes

from lathe.algo import ROLLOUT_CORRECTION_KEYS
from lathe.cluster.dispatch import select_share, update_shares
from lathe.config import load_config, run_plan
from lathe.generation import RolloutOutput
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights
from lathe.rollout.base import to_batch
from lathe.train import parallel
from lathe.train.logprob import response_log_probs
from lathe.train.update import NonFiniteGuard
from lathe.workers.actor import Actor
from lathe.workers.reference import Reference

from .conftest import BASE_OVERRIDES, PAD, VOCAB

pytestmark = pytest.mark.slow

STEPS = 3
SAVED_AFTER = 2            # the checkpoint holds the state after this many steps
JOIN_S = 120               # every wait is bounded: a broken collective fails the test, it never hangs the suite
# pg_clipfrac and ppo_kl are means over micro-batches (verl's), which depend on the cut into ranks: not compared
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/lr")


class NoTokenizer:
    """The tokenizer a checkpoint saves beside the weights: none here."""

    def save_pretrained(self, path) -> None:
        pass


def tiny_model(seed: int = 0, **config) -> LatheCausalLM:
    """Qwen2-shaped, 2 layers, the same weights in every process; `config`: Hugging Face config keys changed."""
    cfg = LatheConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
                                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "max_position_embeddings": 64,
                                    "tie_word_embeddings": False, **config})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.2)
    return model


def ppo_batch(step: int, rows: int = 8):
    """`rows` sequences of random prompts and responses, old log-probs (the starting policy's, perturbed) and
    advantages."""
    g = torch.Generator().manual_seed(step)
    ids = lambda lo, hi: [torch.randint(2, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist() for _ in range(rows)]
    prompts, responses = ids(2, 6), ids(1, 7)
    batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * rows), PAD,
                     n=1)
    mask = batch["response_mask"].float()
    with torch.no_grad():
        logp, _ = response_log_probs(tiny_model().eval(), batch)
    batch["old_log_probs"] = (logp + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    return batch


def train(world: int, fsdp_size: int, *, steps=range(STEPS), save: Path | None = None, resume: Path | None = None,
          overrides: tuple[str, ...] = (), tp: int = 1, engine: bool = False, model_fn=None, log_probs: bool = False,
          grads: bool = False, micro: int | None = None, ref: bool = False):
    """The actor's updates over `steps` on this process's share (a rank of `world`, or one process; with tensor- or
    sequence-parallel groups of `tp` ranks, its group's share): metrics, the full weights at the end (on rank 0), the
    mesh its weights are sharded on, its (tensor-parallel, sequence-parallel) ranks ("places"; None where off) and,
    with `engine`, the weights a rollout engine would load; with `grads`, the last optimizer step's (clipped) full
    gradients; `model_fn`: the policy (`tiny_model` by default); `micro`: the
    micro-batch size, set past the config rules (a one-process twin cutting its micro-batches as ranks with ghost rows
    cut theirs: 5 sequences into 2 + 2 + 1, which the rules refuse for one device); `ref`: the reference's log-probs
    of this process's share of a batch after the updates."""
    cfg = load_config(None, [*BASE_OVERRIDES, "trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                             f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}",
                             "actor_rollout_ref.actor.entropy_coeff=0.01", *overrides], device_count=world)
    if micro is not None:
        cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
    plan = run_plan(cfg, world)
    rc = cfg.algorithm.rollout_correction
    actor = Actor(cfg.actor_rollout_ref, (model_fn or tiny_model)(), device=torch.device("cpu"), seed=0,
                  with_rollout=cfg.actor_rollout_ref.model.lora_rank > 0)      # LoRA trains with a colocated rollout
    reference = Reference(cfg.actor_rollout_ref.ref, actor, plan.mesh("ref") if parallel.in_group() else None,
                          sp_size=plan.ref_sequence_parallel_size if parallel.in_group() else 1) if ref else None
    actor.start_training(plan=plan.actor, total_steps=10, temperature=1.0,
                         max_response_length=cfg.data.max_response_length,
                         rollout_correction={k: getattr(rc, k) for k in ROLLOUT_CORRECTION_KEYS},
                         nonfinite=NonFiniteGuard("actor"), mesh=plan.mesh("actor"))
    if resume is not None:
        actor.load_checkpoint(resume)
    last_grads: dict = {}
    grad_layout: dict = {}      # a sharded model's: {name: (the parameter's placements, its gradient's)}
    if grads:               # the full gradients each optimizer step takes (clipped): the last step's kept
        def keep(*_) -> None:
            with_grads = [(n, p) for n, p in actor.model.named_parameters() if p.grad is not None]
            last_grads.update({n: parallel.to_local(p.grad).clone() for n, p in with_grads})
            grad_layout.update({n: (_placements(p), _placements(p.grad)) for n, p in with_grads})
        actor.optimizer.register_step_pre_hook(keep)
    metrics = []
    for step in steps:
        batch = ppo_batch(step, plan.actor.sequences_per_step)
        shares = update_shares(batch, world // tp, mini_batch_size=plan.actor.mini_batch_sequences, balance=False,
                               ghosts=True)
        metrics.append(actor.update(select_share(batch, shares[parallel.rank() // tp])))
        if save is not None and step + 1 == SAVED_AFTER:
            actor.save_checkpoint(save, NoTokenizer())
    if log_probs or ref:    # forward-only passes over this rank's share, one sequence a micro-batch, after the updates
        batch = ppo_batch(STEPS).select(update_shares(ppo_batch(STEPS), world // tp, mini_batch_size=8,
                                                      balance=False)[parallel.rank() // tp])
    if log_probs:
        metrics.append(actor.compute_log_prob(batch, micro_batch_size=1, temperature=1.0).tensors)
    weight = next(actor.model.parameters())
    placements = tuple("shard" if p.is_shard() else "replicate" for p in getattr(weight, "placements", ()))
    mesh = (tuple(weight.device_mesh.shape), placements) if parallel.in_group() else None
    out = {"metrics": metrics, "weights": parallel.full_state(actor.model), "mesh": mesh,
           "kept_gathered": getattr(actor.model, "_lathe_keep_gathered", None),
           "places": tuple(None if g is None else g.rank for g in (actor.tp, actor.sp))}   # (tp rank, sp rank)
    experts = [p for n, p in actor.model.named_parameters() if ".experts." in n]
    if experts and parallel.in_group():            # a MoE policy: the mesh its experts are sharded on
        out["experts_mesh"] = (experts[0].device_mesh.mesh_dim_names, tuple(experts[0].device_mesh.shape))
    if engine:
        out["engine"] = {k: v.clone() for k, v in actor.weights()}
    if grads:
        out["grads"], out["grad_layout"] = last_grads, grad_layout
    if reference is not None:
        out["ref_log_prob"] = reference.compute_ref_log_prob(batch, micro_batch_size=1,
                                                             temperature=1.0)["ref_log_prob"]
        if parallel.in_group() and reference.model is not None:     # the mesh the reference's weights are on
            out["ref_mesh"] = tuple(next(reference.model.parameters()).device_mesh.shape)
    return out


def _placements(t) -> tuple[str, ...]:
    """A DTensor's placements as "R", "P" or "S<dim>" (the same on each torch version); () for a plain tensor."""
    return tuple("R" if p.is_replicate() else "P" if p.is_partial() else f"S{p.dim}"
                 for p in getattr(t, "placements", ()))


def rank_main(rank: int, world: int, port: int, out: Path, queue, jobs: tuple[dict, ...], fn=None) -> None:
    """One rank of a gloo group: `fn(world, **job)` (`train` by default) for each job in turn, each result saved to
    out/job<i>_rank<rank>.pt."""
    def work():
        for i, job in enumerate(jobs):
            torch.save((fn or train)(world, **job), out / f"job{i}_rank{rank}.pt")
    gloo_rank(rank, world, port, queue, work, JOIN_S)


def run_ranks(world: int, out: Path, *jobs: dict, fn=None) -> list[list[dict]]:
    """`fn(world, **job)` (`train` by default; a module-level function) for each job on `world` processes (one group,
    the jobs in turn): each job's result on each rank."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")      # one server imports torch and lathe once; each rank is a fork of it
    preload = [__name__] + ([fn.__module__] if fn is not None else [])
    ctx.set_forkserver_preload([*preload, "torch.distributed.checkpoint", "torch.distributed.fsdp"])
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, out, queue, jobs, fn), daemon=True)
             for r in range(world)]
    run_processes(procs, queue, JOIN_S)
    return [[torch.load(out / f"job{i}_rank{r}.pt", weights_only=False) for r in range(world)]
            for i in range(len(jobs))]


LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=1e-2")
# 8 sequences a mini-batch, 2 a rank, 1 a micro-batch: 2 micro-batches per optimizer step
KEPT = ("actor_rollout_ref.actor.fsdp_config.keep_gathered=true", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
# 4 prompts x n=3: mini-batches of 6 sequences over 4 ranks, each rank's share padded to 2 with ghost rows (no loss,
# counted nowhere: lathe.cluster.dispatch); seq-mean-token-mean normalises by the sequences, which ghosts must not add
GHOSTS = ("actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """HSDP 2 x 2 on 4 ranks (one group): 3 updates (saving after 2), 2 updates of LoRA adapters, then 2 updates and
    a log-prob pass with the weights kept gathered across 2 micro-batches."""
    root = tmp_path_factory.mktemp("hsdp")
    full, lora, kept, ghosts = run_ranks(4, root / "hsdp", dict(fsdp_size=2, save=root / "ckpt"),
                                         dict(fsdp_size=2, steps=range(2), overrides=LORA),
                                         dict(fsdp_size=2, steps=range(2), overrides=KEPT, log_probs=True),
                                         dict(fsdp_size=-1, steps=range(2), overrides=GHOSTS))
    return root, full, lora, kept, ghosts


def assert_same_run(actual: dict, expected: dict, rel: float = 1e-5) -> None:
    assert len(actual["metrics"]) == len(expected["metrics"])
    for a, b in zip(actual["metrics"], expected["metrics"]):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=rel, name="metrics")
    assert_close_rel(actual["weights"], expected["weights"], rel=rel, name="weights")


def test_hsdp_2x2_updates_as_one_process(runs):
    _, hsdp, _, _, _ = runs
    assert hsdp[0]["mesh"] == ((2, 2), ("replicate", "shard"))       # 2 replicas of 2-way shards
    assert all(r["weights"] == {} for r in hsdp[1:])                 # the full state is rank 0's
    assert_same_run(hsdp[0], train(1, -1))


def test_hsdp_checkpoint_resumes_exactly_in_one_process_and_on_two_ranks(runs):
    root, hsdp, _, _, _ = runs
    last = range(SAVED_AFTER, STEPS)
    one = train(1, -1)
    expected = {"metrics": one["metrics"][SAVED_AFTER:], "weights": one["weights"]}
    assert_same_run(train(1, -1, steps=last, resume=root / "ckpt"), expected)
    [fsdp] = run_ranks(2, root / "fsdp", dict(fsdp_size=-1, steps=last, resume=root / "ckpt"))
    assert fsdp[0]["mesh"] == ((2,), ("shard",))
    assert_same_run(fsdp[0], expected)
    assert_same_run(fsdp[0], {"metrics": hsdp[0]["metrics"][SAVED_AFTER:], "weights": hsdp[0]["weights"]})


def test_hsdp_2x2_trains_lora_adapters_as_one_process(runs):
    """The frozen base and the adapters are sharded and replicated alike; only the adapters train."""
    _, _, hsdp, _, _ = runs
    one = train(1, -1, steps=range(2), overrides=LORA)
    assert_same_run(hsdp[0], one)
    start = tiny_model().state_dict()
    assert any("lora" in k for k in one["weights"])
    assert all(torch.equal(v, start[k]) for k, v in one["weights"].items() if "lora" not in k)   # the base is frozen


def test_weights_kept_gathered_across_micro_batches_update_as_one_process(runs):
    """lathe.train.gathered: one all-gather and one reduce-scatter a mini-batch (gradients accumulated unsharded
    over 2 micro-batches) and one gather for a forward-only pass: the same updates and log-probs as one process."""
    _, _, _, kept, _ = runs
    assert [r["kept_gathered"] for r in kept] == [True] * 4
    one = train(1, -1, steps=range(2), overrides=KEPT, log_probs=True)
    got, want = kept[0]["metrics"], one["metrics"]
    assert_same_run({**kept[0], "metrics": got[:2]}, {**one, "metrics": want[:2]})
    whole = torch.cat([r["metrics"][2]["old_log_probs"].flatten() for r in kept])     # ranks' shares in order
    assert_close_rel(whole, want[2]["old_log_probs"].flatten(), rel=1e-5, name="log-probs")


def test_ghost_rows_pad_an_uneven_split_and_update_as_one_process(runs):
    """Mini-batches of 6 sequences over 4 ranks (2 ghost rows each): the same updates as one process."""
    *_, ghosts = runs
    one = train(1, -1, steps=range(2), overrides=GHOSTS)
    assert_same_run(ghosts[0], one)
