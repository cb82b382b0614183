"""On-policy distillation in fully-async mode (both pools in this process: tests/loop/test_async_inprocess.py): the
trainer pool's ranks score each batch with the teachers before the update, as the synchronous loop's do. On-policy it
is the synchronous loop's distillation."""

from __future__ import annotations

from loop.test_async_inprocess import ON_POLICY, assert_same_steps, in_process_pools, train  # noqa: F401

# the teacher: the built-in model as trainer.seed builds it, not warm-started (the student is: tests/helpers.py)
DISTILL = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=builtin:tiny"]
KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "distillation/loss",
        "distillation/abs_loss")


def test_on_policy_distillation_is_the_synchronous_loops(tmp_path, in_process_pools):
    sync = train(tmp_path / "sync", *DISTILL)
    on_policy = train(tmp_path / "async", *DISTILL, *ON_POLICY, "data.gen_batch_size=2")
    assert_same_steps(sync, on_policy, keys=KEYS)
    assert all(r["distillation/abs_loss"] > 1e-3 for r in sync), "precondition: the teacher is another model"
