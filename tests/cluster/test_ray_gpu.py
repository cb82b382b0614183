"""The distributed path on GPUs (NCCL, FSDP2 with bf16 compute on fp32 shards, one engine per GPU), sized by the
GPUs this machine shows: 2+ GPUs run 2 workers, one GPU runs one worker (LATHE_RAY=1). Either is compared with
the in-process run, which computes the same bf16 forward from the same fp32 weights."""

from __future__ import annotations

import pytest

from helpers import local_gpus, needs_gpus

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from cluster.test_ray import train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_gpus(1)]


def test_gpu_workers_train_as_one_process(tmp_path, monkeypatch):
    workers = min(local_gpus(), 2)
    one = train(tmp_path / "one", "trainer.device=cuda", shared_warm_start=False)    # warm-started on the GPU
    if workers == 1:
        monkeypatch.setenv("LATHE_RAY", "1")
    many = train(tmp_path / "many", "trainer.device=cuda", f"trainer.n_gpus_per_node={workers}",
                 shared_warm_start=False)
    assert many[0]["critic/score/mean"] == one[0]["critic/score/mean"]       # the same samples at step 1
    # pg_loss averages unit-scale advantages times ratios near 1 and is itself near 0: its bf16 noise is absolute
    # (~2e-3 when the in-process run reuses kernels an earlier GPU test compiled; the same before lathe.device)
    floor = {"actor/pg_loss": 0.25}
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        tol = 2e-2 * max(abs(one[0][key]), floor.get(key, 1e-2))
        assert abs(many[0][key] - one[0][key]) <= tol, (key, one[0][key], many[0][key])
    assert many[-1]["perf/max_memory_allocated_gb"] > 0 and "timing_s/update_weights" in many[-1]
    import torch
    if torch.version.hip is None:       # NVML's energy: the process's own GPU, and the Ray workers' read by the driver
        for run in (one, many):
            assert run[-1]["perf/energy_j/update_actor"] > 0 and run[-1]["perf/power_limit_w"] > 0
