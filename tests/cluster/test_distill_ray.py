"""On-policy distillation on two Ray workers (FSDP2 ranks over gloo on CPU): the teacher, sharded like the reference on
the trainer's ranks, gives each rank's share its top-k tokens, and the actor's second (top-k) pass runs on the sharded
student; the run is the one process's."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from helpers import warm_started  # noqa: E402
from lathe.cli import main  # noqa: E402
from lathe.data.builtin import builtin_tokenizer  # noqa: E402
from lathe.models.hf import build_builtin_model  # noqa: E402

pytestmark = pytest.mark.slow
RUN = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "trainer.logger=[console]", "distillation.enabled=true", "distillation.distillation_loss.loss_mode=forward_kl_topk",
       "distillation.distillation_loss.topk=8", "distillation.distillation_loss.log_prob_min_clamp=-10.0",
       "distillation.distillation_loss.distillation_loss_coef=0.5"]
# the losses and the extremes; not the means of micro-batch means (abs_loss, ppo_kl), which follow the micro-batch cut
COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "distillation/loss", "distillation/loss_min",
            "distillation/loss_max", "distillation/student_mass_min", "distillation/teacher_mass_max")


def train(run_dir, *overrides: str) -> list[dict]:
    assert main(["train", f"trainer.default_local_dir={run_dir}", *RUN, *warm_started(), *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_workers_distil_exactly_as_one_process(tmp_path):
    tok, teacher = builtin_tokenizer(), tmp_path / "teacher"
    model = build_builtin_model("tiny", vocab_size=len(tok), seed=7)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(teacher)
    tok.save_pretrained(teacher)
    path = f"distillation.teacher_models.teacher_model.model_path={teacher}"
    one = train(tmp_path / "one", path)
    two = train(tmp_path / "two", path, "trainer.n_gpus_per_node=2")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["distillation/loss"] > 0.01
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
