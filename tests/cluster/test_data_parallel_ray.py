"""Data-parallel attention in `lathe train` (`lathe.engine.data_parallel`) on 2 Ray workers over gloo: verl's
`rollout.data_parallel_size=2` with `expert_parallel_size=2` makes one engine of the two workers' replicas, each with
its own prompts and half the experts; its samples are the one process's and its engines follow the updates; and
fully-async training's rollout pool as such an engine (3 workers) trains as the synchronous loop
(`tests/cluster/test_mesh_gpu.py`'s cases, on CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from cluster.test_mesh_gpu import data_parallel_attention, fully_async_data_parallel  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_engine_of_two_replicas_trains_as_one_process(tmp_path):
    data_parallel_attention(tmp_path, "cpu")


def test_fully_async_replicas_of_data_parallel_attention_train_as_the_synchronous_loop(tmp_path):
    fully_async_data_parallel(tmp_path, "cpu")
