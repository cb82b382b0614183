"""On-policy distillation beside tensor parallelism equals the one-process run (gloo, 2 ranks: one TP group of 2).

- the vocabulary-parallel read of the top-k forward KL (`lathe.train.vocab_parallel.vocab_parallel_topk_log_probs`,
  float64): the log-probs of given tokens, their gradients (hidden states, each rank's rows of the weight) and the
  group's own top k, against the whole vocabulary's;
- the teachers beside the reference's TP 2 (`lathe.workers.teacher`: not cut, FSDP2 over both ranks, each rank
  scoring rows of its own): their log-probs and top k equal the unsharded teacher's;
- the student cut over the group (the actor's TP 2) takes two SGD steps of PPO with the top-k forward KL against that
  teacher's top k, packed and padded: its distillation loss, metrics and weights (so its gradients) equal one
  process's;
- the worker (`ActorRolloutRefWorker`: reference cut over the group, teacher sharded over both ranks, the cut actor's
  AdamW update) gives one process's teacher numbers, reference log-probs and update metrics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_rel
# the worker's `build_builtin_model` builds transformers' Qwen2: imported here, so the forkserver that preloads this
# module imports it once, not each rank
from transformers import Qwen2ForCausalLM  # noqa: F401

from lathe.algo.distillation import DistillationParams
from lathe.batch import Batch
from lathe.cluster.dispatch import even_shares
from lathe.config import load_config, run_plan
from lathe.config.distill import TeacherSpec
from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model
from lathe.train import parallel
from lathe.train.actor import PPOActor
from lathe.train.tensor_parallel import parallelize, tensor_parallel
from lathe.train.ulysses import consecutive_groups
from lathe.train.vocab_parallel import vocab_parallel_topk_log_probs
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker
from lathe.workers.teacher import Teacher

from .test_parallel import run_ranks
from .test_ulysses import COMMON, REL, ppo_batches, tiny

pytestmark = pytest.mark.slow

T, K = 2, 4
VOCAB, HIDDEN, TOKENS = 41, 16, 13        # the vocabulary cut unevenly (21 + 20 rows)
TP = [f"actor_rollout_ref.{role}.fsdp_config.tensor_parallel_size={T}" for role in ("actor", "ref")]
DISTILLED = ("distillation/loss", "actor/pg_loss", "actor/grad_norm", "distillation/student_mass",
             "distillation/teacher_mass")


def vocab_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64),
            torch.randint(0, VOCAB, (TOKENS, K), generator=g), torch.randn(TOKENS, K, generator=g, dtype=torch.float64))


def config(world: int = 1):
    cfg = load_config(None, [*COMMON, *(TP if world > 1 else ()), f"trainer.n_gpus_per_node={world}"])
    return cfg, run_plan(cfg)


def teacher_numbers(path: str, batch, *, mesh=None) -> dict:
    """The teacher's `teacher_log_probs` and top k of `batch`'s rows (sharded over the group's ranks with `mesh`)."""
    cfg, _ = config()
    teacher = Teacher([TeacherSpec("teacher_model", None, path)], cfg.actor_rollout_ref, builtin_tokenizer(),
                      device=torch.device("cpu"), sharded=mesh is not None, mesh=mesh)
    out = dict(teacher.compute_teacher_log_prob(batch, micro_batch_size=2).tensors)
    teacher.topk = K                        # the same teacher in top-k mode (loss_mode=forward_kl_topk)
    return {**out, **teacher.compute_teacher_log_prob(batch, micro_batch_size=2).tensors}


def student_run(batch, *, remove_padding: bool, world: int = 1) -> dict:
    """Two SGD steps of the actor (PPO + the top-k forward KL) over `batch`, cut over the TP group in a rank."""
    cfg, plan = config(world)
    tp = tensor_parallel(plan.mesh("actor"), torch.device("cpu")) if world > 1 else None
    model = tiny(0)
    if world > 1:
        parallelize(model, tp)
        parallel.shard_model(model, device=torch.device("cpu"), mesh=plan.mesh("actor"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    distill = DistillationParams(loss_mode="forward_kl_topk", topk=K, use_task_rewards=True, loss_max_clamp=10.0,
                                 log_prob_min_clamp=-10.0)
    actor = PPOActor(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), cfg.actor_rollout_ref.actor,
                     mini_batch_size=plan.actor.mini_batch_sequences_per_device, temperature=0.7,
                     max_response_length=6, use_remove_padding=remove_padding, tp=tp, distillation=distill)
    metrics = actor.update_policy(batch)
    weights = (parallel.full_tensors(model) if world > 1 else ((k, p.detach()) for k, p in model.named_parameters()))
    return {"metrics": metrics, "weights": {k: t.clone() for k, t in weights}}


def worker_run(batch, teacher: str, world: int = 1) -> dict:
    """The actor/reference/teacher worker as the driver calls it (the actor's and reference's TP 2 over the ranks):
    the teacher's numbers of this rank's own rows, the reference's log-probs and one step's update of the TP group's
    share (the whole batch)."""
    cfg = load_config(None, [*COMMON, *(TP if world > 1 else ()), f"trainer.n_gpus_per_node={world}",
                             "actor_rollout_ref.model.path=builtin:tiny", "distillation.enabled=true",
                             f"distillation.teacher_models.teacher_model.model_path={teacher}",
                             "distillation.distillation_loss.loss_mode=forward_kl_topk",
                             f"distillation.distillation_loss.topk={K}"])
    tok = builtin_tokenizer()
    worker = ActorRolloutRefWorker(cfg, build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok,
                                   plan=run_plan(cfg), total_steps=10, device=torch.device("cpu"), rollout=False)
    rows = even_shares(batch, world, balance=True)[parallel.rank()] if world > 1 else list(range(len(batch)))
    out = {"rows": rows, "teacher": worker.compute_teacher_log_prob(batch.select(rows)).tensors,
           "ref": worker.compute_ref_log_prob(batch)["ref_log_prob"]}
    batch = Batch(dict(batch.tensors), dict(batch.non_tensors))
    batch["ref_log_prob"] = out["ref"]
    out["metrics"] = worker.update_actor(batch)
    return out


# -- what each rank runs -------------------------------------------------------------------------------------------
def rank_vocab(group) -> dict:
    hidden, weight, ids, w = vocab_inputs()
    h, local = hidden.clone().requires_grad_(), weight.chunk(T)[dist.get_rank(group)].clone().requires_grad_()
    logp, own = vocab_parallel_topk_log_probs(h, local, ids, group, vocab_size=VOCAB, temperature=0.7)
    (logp * w).sum().backward()
    return {"logp": logp.detach(), "own": own, "grad_h": h.grad, "grad_w": local.grad}


def rank_job(world: int, *, root: str, teacher: str) -> dict:
    batch = torch.load(Path(root) / "batch.pt", weights_only=False)
    rows = even_shares(batch, world, balance=True)[parallel.rank()]       # the teachers' shares: one per rank
    _, plan = config(world)
    assert plan.mesh("ref").tp == T
    return {"vocab": rank_vocab(consecutive_groups(T).group), "rows": rows,
            "teacher": teacher_numbers(teacher, batch.select(rows), mesh=plan.mesh("ref")),
            "student": {rp: student_run(batch, remove_padding=rp, world=world) for rp in (True, False)},
            "worker": worker_run(batch, teacher, world)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The inputs, the one-process teacher, and the two ranks' results."""
    root = tmp_path_factory.mktemp("distill_tp")
    tok, path = builtin_tokenizer(), root / "teacher"
    build_builtin_model("tiny", vocab_size=len(tok), seed=5).save_pretrained(path)
    tok.save_pretrained(path)
    batch = ppo_batches(tiny(0), tiny(1, value=True))[0]
    one = teacher_numbers(str(path), batch)
    batch.update(Batch(one))
    batch["teacher_topk_ids"] = one["teacher_topk_ids"] % tiny(0).config.vocab_size   # the student's smaller vocabulary
    torch.save(batch, root / "batch.pt")
    ranks = run_ranks(T, root / "ranks", dict(root=str(root), teacher=str(path)), fn=rank_job)[0]
    return batch, one, ranks, path


# -- the checks ----------------------------------------------------------------------------------------------------
def test_vocab_parallel_top_k_equals_the_whole_vocabulary(runs):
    hidden, weight, ids, w = vocab_inputs()
    h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_all = torch.log_softmax(h @ wt.t() / 0.7, dim=-1)
    logp = logp_all.gather(-1, ids)
    (logp * w).sum().backward()
    got = [r["vocab"] for r in runs[2]]
    for r in got:
        assert_close_rel(r["logp"], logp.detach(), 1e-12, name="log-probs of the given tokens")
        assert_close_rel(r["grad_h"], h.grad, 1e-12, name="hidden gradient")
        assert torch.equal(r["own"], logp_all.detach().topk(K, dim=-1).indices)
    assert_close_rel(torch.cat([r["grad_w"] for r in got]), wt.grad, 1e-12, name="weight gradient")


def test_teachers_beside_tensor_parallelism_score_as_one_process(runs):
    batch, one, ranks, _ = runs
    assert sorted(np.concatenate([r["rows"] for r in ranks]).tolist()) == list(range(len(batch)))
    mask = batch["response_mask"].bool()
    for key in ("teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids"):
        got = torch.zeros_like(one[key])
        for r in ranks:
            got[r["rows"]] = r["teacher"][key]
        if key == "teacher_topk_ids":
            assert torch.equal(got[mask], one[key][mask])
        else:
            assert_close_rel(got[mask], one[key][mask], REL, name=key)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_a_tensor_parallel_student_distils_as_one_process(runs, remove_padding):
    batch, _, ranks, _ = runs
    want = student_run(batch, remove_padding=remove_padding)
    for r in ranks:
        got = r["student"][remove_padding]
        assert_close_rel([got["metrics"][k] for k in DISTILLED], [want["metrics"][k] for k in DISTILLED], REL,
                         name="distillation metrics")
        # the tied lm_head is the embeddings: one name in one process
        assert_close_rel({k: got["weights"][k] for k in want["weights"]}, want["weights"], REL,
                         name="weights after two steps")


def test_the_worker_distils_beside_tensor_parallelism_as_one_process(runs):
    """`ActorRolloutRefWorker` builds the reference cut over the group and the teacher sharded over both ranks (their
    meshes in that order on every rank) and updates the cut actor: the same numbers as one process's worker."""
    batch, _, ranks, path = runs
    want = worker_run(batch, str(path))
    mask = batch["response_mask"].bool()
    for key in ("teacher_topk_log_probs", "teacher_topk_ids"):
        got = torch.zeros_like(want["teacher"][key])
        for r in ranks:
            got[r["worker"]["rows"]] = r["worker"]["teacher"][key]
        assert_close_rel(got[mask].double(), want["teacher"][key][mask].double(), REL, name=key)
    for r in ranks:
        assert_close_rel(r["worker"]["ref"], want["ref"], REL, name="reference log-probs")
        assert_close_rel([r["worker"]["metrics"][k] for k in DISTILLED], [want["metrics"][k] for k in DISTILLED], REL,
                         name="the worker's update")
