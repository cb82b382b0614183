"""`trainer.restart_on_worker_failure` in fully-async mode (both pools in this process:
tests/loop/test_async_inprocess.py): a rank lost after the step-2 checkpoint restarts both pools, the trainer loads
step 2, the replicas take its weights, and the run ends as the uninterrupted one, each step logged once and each
prompt trained once."""

from __future__ import annotations

import json

from lathe.ckpt.checkpoint import LATEST
from lathe.cluster.worker_group import WorkerGroupError
from loop.test_async_inprocess import ON_POLICY, LocalGroup, in_process_pools, train  # noqa: F401

ARGS = [*ON_POLICY, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.restart_on_worker_failure=1"]
KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


def test_a_lost_rank_restarts_both_pools_from_the_last_checkpoint(tmp_path, in_process_pools, monkeypatch):
    plain = train(tmp_path / "plain", *ARGS, f"trainer.rollout_data_dir={tmp_path / 'plain-dumps'}")
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    lost, gather = [], LocalGroup.gather

    def gather_losing_a_rank(self, futures, what, watching=None):   # the trainer's first call after step 2's save
        if self.name == "trainer" and not lost and (run / LATEST).exists() and (run / LATEST).read_text() == "2":
            lost.append(what)
            for f in futures:
                f is None or f.result(timeout=120)
            raise WorkerGroupError(f"rank 0 on 127.0.0.1 died during {what} (injected)")
        return gather(self, futures, what)

    monkeypatch.setattr(LocalGroup, "gather", gather_losing_a_rank)
    rows = train(run, *ARGS, f"trainer.rollout_data_dir={dumps}")
    assert lost, "precondition: a rank was lost"
    assert [r["step"] for r in rows] == [1, 2, 3, 4]                  # steps 3 and 4 once, after the restart
    for a, b in zip(plain, rows):
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (a["step"], key, a[key], b[key])
    trained = [json.loads(line)["uid"] for step in range(1, 5)
               for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert len(trained) == len(set(trained)) * 4                       # each prompt's 4 samples trained once
