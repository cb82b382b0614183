"""The teacher part of a worker: the frozen teacher model(s) of on-policy distillation (verl's `distillation.*`).

Each teacher (`lathe.config.distill.teachers`) is loaded with the policy's loader (lathe's decoder when it runs the
architecture, else transformers; a vision-language teacher sees the rows' images), frozen, and placed like the
reference (`actor_rollout_ref.ref.fsdp_config`: its compute dtype, FSDP2 sharding over the trainer's ranks when the
actor is sharded, pinned CPU memory between uses with `param_offload`). Tensor parallelism does not cut a teacher:
where the reference's mesh has a tp dim (its or the actor's `tensor_parallel_size`), the teacher is sharded by FSDP2
alone over the same ranks (`MeshPlan.without_tensor_parallel`: the same memory per rank as the reference's slices),
each rank scoring rows of its own, so any model the teacher loads as runs (no head or vocabulary split to check),
and its numbers are the unsharded teacher's. `compute_teacher_log_prob` scores the
student's sampled responses with one forward pass (`lathe.train.logprob.batched_log_probs`, the reference's code):
`teacher_log_probs` (B, R), at temperature 1 (verl: the teacher's prompt log-probs ignore the sampling temperature);
with `loss_mode=forward_kl_topk` its k most likely tokens and their log-probs instead (`lathe.train.topk`).

Several teachers: a row goes to the teacher whose `key` is its `data_source`. Unsharded, each teacher scores only
its rows; sharded, every rank runs every teacher over its whole share (FSDP2's gathers are collective, and the
ranks' rows route differently), keeping each row's own teacher's numbers.

A teacher must share the student's tokenizer: every token id of the student's vocabulary means the same token to
the teacher, and the teacher's output layer covers them; anything else is refused when the teacher loads.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np
import torch

from lathe.algo.distillation import DistillationParams
from lathe.batch import Batch
from lathe.config.distill import TeacherSpec
from lathe.config.plan import MeshPlan
from lathe.dtypes import short_name
from lathe.models.frozen import frozen_copy
from lathe.models.hf import load_policy, load_tokenizer, select_impl
from lathe.train import parallel
from lathe.train.logprob import batched_log_probs
from lathe.train.offload import HostWeights, offload_flags
from lathe.train.precision import resolve_policy
from lathe.train.topk import batched_teacher_topk

log = logging.getLogger("lathe")
FSDP_KEY = "actor_rollout_ref.ref.fsdp_config"
D = "distillation.teacher_models"


def distillation_params(distillation_cfg) -> DistillationParams | None:
    """The actor's distillation loss from `distillation.distillation_loss` (None when distillation is off)."""
    if not distillation_cfg.enabled:
        return None
    loss = distillation_cfg.distillation_loss
    return DistillationParams(
        loss_mode=loss.loss_mode, use_policy_gradient=loss.use_policy_gradient, use_task_rewards=loss.use_task_rewards,
        distillation_loss_coef=loss.distillation_loss_coef, loss_max_clamp=loss.loss_max_clamp,
        clip_ratio=loss.clip_ratio, clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high,
        topk=loss.topk, log_prob_min_clamp=loss.log_prob_min_clamp)


def check_vocabulary(spec: TeacherSpec, teacher_tokenizer, student_tokenizer, output_rows: int) -> None:
    """Refuse a teacher whose token ids mean other tokens than the student's, or whose output layer is shorter."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    differ = [tok for tok, i in student.items() if teacher.get(tok) != i]
    if differ:
        raise ValueError(f"{D}.{spec.name}.model_path={spec.model_path}: the teacher's tokenizer differs from the "
                         f"student's ({len(differ)} of the student's {len(student)} tokens have another id or none, "
                         f"e.g. {differ[:3]}); on-policy distillation scores the student's token ids with the "
                         "teacher. Fix: use a teacher of the student's model family (the same tokenizer).")
    if output_rows < len(student_tokenizer):
        raise ValueError(f"{D}.{spec.name}.model_path={spec.model_path}: the teacher's output layer has "
                         f"{output_rows} rows, fewer than the student's {len(student_tokenizer)} tokens. Fix: use a "
                         "teacher with the student's vocabulary.")


def output_rows(model) -> int:
    """The number of tokens a causal LM's output layer scores."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


class TeacherModel:
    """One frozen teacher, placed like the reference."""

    def __init__(self, spec: TeacherSpec, arr, student_tokenizer, *, device: torch.device, sharded: bool,
                 mesh: MeshPlan | None, seed: int):
        self.spec, self.device, self.vocab = spec, device, len(student_tokenizer)   # top-k among the student's ids
        m, fsdp_cfg = arr.model, arr.ref.fsdp_config
        tokenizer = load_tokenizer(spec.model_path, trust_remote_code=m.trust_remote_code)
        loaded = select_impl(load_policy(spec.model_path, impl=m.impl, trust_remote_code=m.trust_remote_code,
                                         seed=seed), m.impl, role="teacher")
        check_vocabulary(spec, tokenizer, student_tokenizer, output_rows(loaded))
        policy = resolve_policy(fsdp_cfg, device, key=FSDP_KEY, trainable=False)
        self.model = frozen_copy(loaded, policy.param_dtype, torch.device("cpu") if sharded else device)
        del loaded
        offload = offload_flags(fsdp_cfg, device, key=FSDP_KEY, frozen=True)["offload_params"]
        if sharded:         # FSDP2 only, over the ranks of the reference's mesh (its tp dim folded in)
            mesh = mesh.without_tensor_parallel() if mesh is not None else None
            parallel.shard(self.model, fsdp_cfg, policy, device, mesh)
        self.host = HostWeights(self.model, device) if offload and not sharded else None
        log.info("teacher %s: %s, %s weights%s%s", spec.name, spec.model_path, short_name(policy.param_dtype),
                 ", in CPU memory between uses" * offload, parallel.mesh_note(mesh) if sharded else "")

    def on_device(self):
        return self.host.on_device() if self.host is not None else nullcontext(self.model)

    def log_probs(self, batch: Batch, *, remove_padding: bool, topk: int | None = None, **budget) -> dict:
        """{"teacher_log_probs": (B, R)} of the sampled tokens, or with `topk` {"teacher_topk_log_probs",
        "teacher_topk_ids": (B, R, k)} of the teacher's k most likely tokens."""
        with self.on_device() as model:
            if topk:
                values, ids = batched_teacher_topk(model, batch.to(self.device), k=topk, vocab=self.vocab,
                                                   remove_padding=remove_padding, **budget)
                return {"teacher_topk_log_probs": values.cpu(), "teacher_topk_ids": ids.cpu()}
            logp, _ = batched_log_probs(model, batch.to(self.device), temperature=1.0, remove_padding=remove_padding,
                                        **budget)
        return {"teacher_log_probs": logp.cpu()}


class Teacher:
    """`compute_teacher_log_prob` of the run's teacher(s), routed per row by `data_source`."""

    def __init__(self, specs: list[TeacherSpec], arr, student_tokenizer, *, device: torch.device, sharded: bool,
                 mesh: MeshPlan | None = None, seed: int = 0, topk: int | None = None):
        """`topk`: give the teacher's top-k tokens and log-probs (loss_mode=forward_kl_topk), else the sampled
        tokens' log-probs."""
        self.sharded, self.remove_padding, self.topk = sharded, arr.model.use_remove_padding, topk
        self.models = [TeacherModel(s, arr, student_tokenizer, device=device, sharded=sharded, mesh=mesh, seed=seed)
                       for s in specs]

    def routes(self, batch: Batch) -> list[np.ndarray]:
        """Row indices of each teacher (a single teacher takes every row)."""
        if len(self.models) == 1:
            return [np.arange(len(batch))]
        sources = np.asarray([str(s) for s in batch["data_source"]], dtype=object)
        keys = [t.spec.key for t in self.models]
        unknown = sorted(set(sources) - set(keys))
        if unknown:
            raise ValueError(f"distillation: rows with data_source {unknown} have no teacher (the teachers' keys: "
                             f"{keys}). Fix: give each data_source of the training data a teacher ({D}.<name>.key).")
        return [np.flatnonzero(sources == k) for k in keys]

    def compute_teacher_log_prob(self, batch: Batch, *, micro_batch_size: int, **budget) -> Batch:
        """`teacher_log_probs` (B, R), or with `topk` `teacher_topk_log_probs` / `teacher_topk_ids` (B, R, k); each
        row its own teacher's."""
        B, R = batch["responses"].shape
        shapes = ({"teacher_topk_log_probs": (torch.float32, (B, R, self.topk)),
                   "teacher_topk_ids": (torch.long, (B, R, self.topk))} if self.topk
                  else {"teacher_log_probs": (torch.float32, (B, R))})
        out = {k: torch.zeros(shape, dtype=dtype) for k, (dtype, shape) in shapes.items()}
        kw = dict(micro_batch_size=micro_batch_size, remove_padding=self.remove_padding, topk=self.topk, **budget)
        for teacher, rows in zip(self.models, self.routes(batch)):
            if self.sharded:            # every rank runs every teacher (collective gathers); keep its own rows
                for k, v in teacher.log_probs(batch, **kw).items():
                    out[k][rows] = v[rows]
            elif len(rows):
                for k, v in teacher.log_probs(batch.select(rows.tolist()), **kw).items():
                    out[k][rows] = v
        return Batch(out)
