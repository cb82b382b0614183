"""`lathe train` with Ulysses sequence parallelism on two Ray workers (one sequence-parallel group of 2 gloo ranks on
the CPU) equals the one-process run: the actor's and the reference's packed forwards split over the two ranks, each
micro-batch's token budget twice the per-device one (verl's rule), the same losses and gradient norms."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from loop.test_ppo import read_metrics, run  # noqa: E402

pytestmark = pytest.mark.slow
A = "actor_rollout_ref.actor"
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
            "response_length/mean")


def test_two_workers_in_one_sequence_parallel_group_equal_one_process(tmp_path):
    common = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
              "trainer.device=cpu", "actor_rollout_ref.model.use_remove_padding=true", f"{A}.use_kl_loss=true",
              f"{A}.kl_loss_coef=0.1", f"{A}.use_dynamic_bsz=true"]
    run(tmp_path, *common, f"{A}.ppo_max_token_len_per_gpu=40", name="one")     # the longest row: 32 + 4 tokens
    run(tmp_path, *common, f"{A}.ppo_max_token_len_per_gpu=20", "trainer.n_gpus_per_node=2",
        f"{A}.ulysses_sequence_parallel_size=2", name="sp")
    one, sp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "sp")
    assert sorted(one) == sorted(sp) == [1, 2]
    assert one[2]["actor/grad_norm"] > 0 and one[2]["actor/kl_loss"] > 0
    for step in (1, 2):
        for key in COMPARED:
            assert sp[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (step, key)
