"""`lathe sft` on two Ray workers (FSDP2 ranks over gloo on CPU): the same steps as one process, and a sharded
checkpoint that one process resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from lathe.cli import main  # noqa: E402

pytestmark = pytest.mark.slow
RUN = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2", "data.train_batch_size=8",
       "data.micro_batch_size_per_gpu=2", "data.val_max_samples=8", "optim.lr=3e-3", "trainer.logger=[console]",
       "trainer.device=cpu"]


def sft(run_dir, *overrides: str) -> list[dict]:
    assert main(["sft", f"trainer.default_local_dir={run_dir}", *RUN, *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same(a: dict, b: dict) -> None:
    for key in ("train/loss", "train/grad_norm", "train/global_tokens", "val/loss"):
        if key in a or key in b:
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-3), (key, a[key], b[key])


def test_two_workers_train_as_one_process_and_their_checkpoint_resumes_in_one(tmp_path):
    one = sft(tmp_path / "one")
    two = sft(tmp_path / "two", "trainer.n_gpus_per_node=2")
    assert len(one) == len(two) == 4 and "val/loss" in two[1]
    for a, b in zip(one, two):
        assert_same(a, b)
    assert len(list((tmp_path / "two" / "global_step_2" / "actor" / "sharded").glob("*.distcp"))) == 2
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copytree(tmp_path / "two" / "global_step_2", run / "global_step_2")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = sft(run)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, one[2:]):
        assert_same(a, b)
