"""verl's ``distillation`` group: on-policy distillation from one or several frozen teacher models.

The student (``actor_rollout_ref``) samples as usual; each sample's response is scored by a teacher (chosen by the
row's ``teacher_key`` column when there are several), and the per-token reverse KL to the teacher (or the forward
KL over the teacher's top-k tokens) enters the actor's loss (``lathe.algo.distillation``). lathe computes a teacher's
log-probs with one forward pass over the student's tokens, on the trainer's own devices (colocated, as the reference
is), or with ``nnodes`` and ``n_gpus_per_node`` both >= 1 on a pool of the teachers' own (synchronous or fully-async
training; a whole copy of every teacher per device); a teacher's ``inference.*`` engine settings and ``num_replicas``
have no effect, and ``lathe.config.distill`` names them in a warning and checks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .coerce import spec


@dataclass
class DistillationLossConfig:
    """verl ``distillation.distillation_loss``: how the teacher's signal enters the actor's loss."""

    loss_mode: str = spec("k3", "Per-token divergence: k1|kl, k3|low_var_kl, k2|mse, abs (single-sample estimators "
                                "of the reverse KL(student || teacher) at the sampled tokens), or forward_kl_topk "
                                "(the forward KL over the teacher's top-k tokens; use_policy_gradient=false).")
    topk: int | None = spec(32, "k of forward_kl_topk: the teacher's most likely tokens compared at each position.")
    use_task_rewards: bool = spec(True, "true: the actor's loss is the task (PPO) loss + distillation_loss_coef x "
                                        "the distillation loss; false: the distillation loss alone (rewards are "
                                        "still computed and logged).")
    distillation_loss_coef: float = spec(1.0, "Weight of the distillation loss when use_task_rewards=true.")
    loss_max_clamp: float | None = spec(None, "Clamp each token's loss to [-value, value]; null = no clamp.")
    log_prob_min_clamp: float | None = spec(None, "Lower clamp of the log-probs inside the top-k losses "
                                                  "(forward_kl_topk only); null = none.")
    use_policy_gradient: bool = spec(False, "true: the negative per-token loss is the advantage of a PPO clipped "
                                            "surrogate (the reverse KL as a reward; use k1); false: the loss is "
                                            "back-propagated directly (use k3).")
    policy_loss_mode: str = spec("vanilla", "The surrogate of use_policy_gradient=true; verl implements vanilla.")
    clip_ratio: float = spec(0.2, "PPO clip range of that surrogate.")
    clip_ratio_low: float = spec(0.2, "Its lower clip range.")
    clip_ratio_high: float = spec(0.2, "Its upper clip range.")


def _default_teachers() -> dict[str, Any]:
    return {"teacher_model": {"key": None, "model_path": None, "num_replicas": 0, "inference": {}}}


@dataclass
class DistillationConfig:
    """verl ``distillation``: on-policy distillation (teacher log-probs on the student's samples)."""

    enabled: bool = spec(False, "Distil from the teacher model(s) of teacher_models.")
    teacher_models: dict[str, Any] = spec(
        factory=_default_teachers,
        help="Teachers by entry name, each {model_path, key, num_replicas, inference.*}: model_path is the teacher "
             "checkpoint (same tokenizer as the student), key the value of the teacher_key column routed to it "
             "(several teachers). verl's default entry `teacher_model` is dropped when other entries are given.")
    teacher_key: str = spec("data_source", "Column choosing each row's teacher when there are several (lathe: "
                                           "data_source, the column lathe keeps per row).")
    distillation_loss: DistillationLossConfig = spec(factory=DistillationLossConfig, help="The loss.")
    n_gpus_per_node: int = spec(8, "GPUs per node of the teachers' own pool (with nnodes >= 1; one whole copy of "
                                   "every teacher per device; synchronous or fully-async training).")
    nnodes: int = spec(0, "Nodes of the teachers' own pool; 0 (verl's default): the teachers run on the trainer's "
                          "devices, placed like the reference.")
