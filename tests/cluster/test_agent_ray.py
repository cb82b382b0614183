"""The agent loop on 2 Ray workers (CPU, gloo) trains exactly as in one process: each worker runs its share's
trajectories and tools (the tool class imported by file path in the worker)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from agent_task import agent_task, metric  # noqa: E402
from lathe.cli import main  # noqa: E402

COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "num_turns/mean", "agent/tool_calls/mean",
            "response_length/mean")


@pytest.mark.slow
def test_two_workers_run_the_agent_loop_as_one_process(tmp_path):
    runs = {}
    for workers in (1, 2):
        run = tmp_path / f"w{workers}"
        assert main(["train", *agent_task(), "trainer.total_training_steps=1", "trainer.test_freq=-1",
                     f"trainer.n_gpus_per_node={workers}", f"trainer.default_local_dir={run}"]) == 0
        runs[workers] = {key: metric(run, key) for key in COMPARED}
    for key in COMPARED:
        for a, b in zip(runs[1][key], runs[2][key]):
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), (key, runs[1][key], runs[2][key])
    assert runs[2]["agent/tool_calls/mean"][0] > 0
