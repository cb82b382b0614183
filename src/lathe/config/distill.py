"""The teachers of on-policy distillation (``distillation.*``), resolved and checked before any model loads.

verl's rules, kept: the default entry ``teacher_model`` serves alone, or is dropped when other entries are given
(verl drops it silently; lathe warns when it had a model_path); with one teacher every row goes to it whatever its
key; with several, each needs a distinct ``key`` and a row goes to the teacher whose key is its ``teacher_key``
column's value. ``loss_mode=k1`` needs ``use_policy_gradient=true``, ``forward_kl_topk`` a ``topk``; a teacher's
``inference.max_model_len`` must hold the student's prompt, response and one more token.

lathe's placement: every teacher runs a forward pass over the student's tokens (no generation), on the trainer's
devices (colocated, like the reference), or, with ``nnodes`` and ``n_gpus_per_node`` both >= 1 (verl's teacher pool;
verl's defaults, nnodes=0, ask for none), on a worker group of its own (in the synchronous loop and beside the trainer
and rollout pools of fully-asynchronous training), a whole copy of every teacher on each of its ranks
(``lathe.cluster.teacher_pool``). Beside tensor parallelism (the actor's or the reference's
``fsdp_config.tensor_parallel_size``) a colocated teacher is not cut: FSDP2 shards it over the ranks the reference's
slices are sharded over, each rank scoring rows of its own (``lathe.workers.teacher``), and the student's top-k
log-probs come from its vocabulary-parallel lm_head (``lathe.train.vocab_parallel``). A teacher's ``num_replicas``
and engine settings (``inference.*``) are named once in a warning and otherwise left (``policy_loss_mode``:
``support.py``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import ProblemList
from .plan import teacher_devices

D = "distillation"
ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")      # lathe.algo.distillation.ESTIMATOR_MODES
TOPK = ("forward_kl_topk",)
DEFAULT_ENTRY = "teacher_model"
# inference.* keys lathe reads (a check) or verl copies from the rollout: not named in the warning
QUIET_INFERENCE = {"max_model_len", "name", "prompt_length", "response_length", "temperature", "_target_"}


class DistillationPlacementWarning(UserWarning):
    """Teacher settings that place or run a teacher engine, which lathe's colocated teachers do not use."""


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher as lathe runs it: its entry name, routing key (None: the only teacher) and checkpoint."""

    name: str
    key: str | None
    model_path: str
    inference: dict[str, Any] = field(default_factory=dict)


def entries(cfg) -> dict[str, dict]:
    """The teacher entries verl would use (``teacher_model`` dropped when others are given)."""
    given = {k: dict(v or {}) for k, v in cfg.distillation.teacher_models.items()}
    if len(given) > 1:
        given.pop(DEFAULT_ENTRY, None)
    return given


def teachers(cfg) -> list[TeacherSpec]:
    """The run's teachers (``check_distillation`` has passed): one routes every row, several by key."""
    given = entries(cfg)
    single = len(given) == 1
    return [TeacherSpec(name, None if single else str(e.get("key")), str(e["model_path"]),
                        dict(e.get("inference") or {})) for name, e in given.items()]


def check_distillation(cfg, problems: ProblemList) -> None:
    """Every refusal of a distillation setting lathe cannot run, and one warning for those it leaves."""
    d = cfg.distillation
    if not d.enabled:
        return
    _check_loss(cfg, d.distillation_loss, problems)
    given = entries(cfg)
    dropped = cfg.distillation.teacher_models.get(DEFAULT_ENTRY) or {}
    if DEFAULT_ENTRY not in given and dropped.get("model_path"):
        warnings.warn(f"{D}.teacher_models.{DEFAULT_ENTRY}.model_path={dropped['model_path']} is dropped: other "
                      f"teacher entries are given, and verl then drops the default entry. Give that teacher an "
                      f"entry name of its own to keep it.", UserWarning, stacklevel=4)
    if not given:
        problems.add(f"{D}.enabled=true needs a teacher, and {D}.teacher_models is empty. Fix: set "
                     f"{D}.teacher_models.{DEFAULT_ENTRY}.model_path=<teacher checkpoint>.")
    for name, entry in given.items():
        if not entry.get("model_path"):
            problems.add(f"{D}.enabled=true, but {D}.teacher_models.{name}.model_path is not set: a teacher needs "
                         f"its checkpoint. Fix: set it (the teacher must use the student's tokenizer), or set "
                         f"{D}.enabled=false.")
        _check_length(cfg, name, entry, problems)
    if len(given) > 1:
        _check_routing(cfg, given, problems)
    _warn_placement(cfg, given)


def _check_loss(cfg, loss, problems: ProblemList) -> None:
    key = f"{D}.distillation_loss"
    if loss.loss_mode in TOPK:
        _check_topk(cfg, loss, problems)
    elif loss.loss_mode not in ESTIMATORS:
        problems.add(f"{key}.loss_mode={loss.loss_mode!r} is not a distillation loss. Fix: one of "
                     f"{', '.join(ESTIMATORS + TOPK)}.")
    elif loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        problems.add(f"{key}.loss_mode={loss.loss_mode} with use_policy_gradient=false: back-propagating k1 is "
                     "wrong (its gradient does not depend on the teacher). Fix: set use_policy_gradient=true (k1 as "
                     "a reward), or loss_mode=k3.")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if getattr(loss, name) <= 0:
            problems.add(f"{key}.{name}={getattr(loss, name)} must be > 0. Fix: set it, e.g. to 0.2 (verl's default).")
    if loss.loss_max_clamp is not None and loss.loss_max_clamp <= 0:
        problems.add(f"{key}.loss_max_clamp={loss.loss_max_clamp} clamps every token's loss to 0. Fix: set it > 0 "
                     "(e.g. 10.0), or null for no clamp.")


def _check_topk(cfg, loss, problems: ProblemList) -> None:
    """The top-k forward KL reads the student's top-k log-probs in a second pass over each micro-batch."""
    key = f"{D}.distillation_loss"
    if loss.topk is None or loss.topk < 1:
        problems.add(f"{key}.topk={loss.topk}: loss_mode=forward_kl_topk needs the number of the teacher's most "
                     "likely tokens it compares. Fix: set it >= 1 (e.g. 32, verl's default).")
    if loss.use_policy_gradient:
        warnings.warn(f"{key}.loss_mode=forward_kl_topk with use_policy_gradient=true: the update then moves only the "
                      "sampled token's log-prob (the top-k loss is its advantage), so how the other top-k tokens should "
                      "move is lost; verl warns the same. use_policy_gradient=false back-propagates the top-k KL "
                      "itself.", UserWarning, stacklevel=5)
    sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp > 1:
        problems.add(f"{key}.loss_mode=forward_kl_topk with actor_rollout_ref.actor.ulysses_sequence_parallel_size="
                     f"{sp}: lathe reads the student's top-k log-probs without sequence parallelism. Fix: set the "
                     "actor's ulysses_sequence_parallel_size=1, or use loss_mode=k3 / k1.")


def _check_length(cfg, name: str, entry: dict, problems: ProblemList) -> None:
    """verl's rule: the teacher's context holds the student's prompt, its response and one more token."""
    limit = (entry.get("inference") or {}).get("max_model_len")
    need = cfg.data.max_prompt_length + cfg.data.max_response_length + 1
    if limit is not None and int(limit) < need:
        problems.add(f"{D}.teacher_models.{name}.inference.max_model_len={limit} is shorter than the student's "
                     f"prompt + response + 1 = {need} tokens (data.max_prompt_length + max_response_length + 1). "
                     "Fix: raise it to at least that, or remove it.")


def _check_routing(cfg, given: dict[str, dict], problems: ProblemList) -> None:
    d = cfg.distillation
    if d.teacher_key != "data_source":
        problems.add(f"{D}.teacher_key={d.teacher_key!r}: lathe routes rows to teachers by their data_source "
                     "column (the one it keeps per row). Fix: set teacher_key=data_source and give each teacher "
                     "the data_source of its rows as key.")
    keys: dict[str, str] = {}
    for name, entry in given.items():
        key = entry.get("key")
        if key is None:
            problems.add(f"{D}.teacher_models.{name}.key is not set: with several teachers each needs the "
                         f"{d.teacher_key} value of the rows it scores. Fix: set it, e.g. "
                         f"+{D}.teacher_models.{name}.key=openai/gsm8k.")
        elif str(key) in keys:
            problems.add(f"{D}.teacher_models.{name}.key={key!r} is also the key of teacher {keys[str(key)]}: each "
                         "row needs one teacher. Fix: give each teacher a distinct key.")
        else:
            keys[str(key)] = name


def _warn_placement(cfg, given: dict[str, dict]) -> None:
    """One warning naming each teacher's pool and engine settings (the pool's own size keys: the registry)."""
    named = []
    for name, entry in given.items():
        if entry.get("num_replicas"):
            named.append(f"{D}.teacher_models.{name}.num_replicas={entry['num_replicas']}")
        named += [f"{D}.teacher_models.{name}.inference.{k}" for k in (entry.get("inference") or {})
                  if k not in QUIET_INFERENCE]
    if named:
        where = ("on its own pool (distillation.nnodes x n_gpus_per_node, a whole copy on each device)"
                 if teacher_devices(cfg) else "on the trainer's own devices (like the reference; "
                 "actor_rollout_ref.ref.fsdp_config places it)")
        warnings.warn(f"lathe runs each teacher {where}, one forward pass over the student's tokens, so these "
                      f"teacher replica and engine settings have no effect: {', '.join(named)}",
                      DistillationPlacementWarning, stacklevel=4)
