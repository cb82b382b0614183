import atexit
import multiprocessing.forkserver as forkserver
import os
import shutil
import tempfile

import pytest
import torch

# Under pytest-xdist (`-n 2`, the README's command) each worker process takes one thread: two workers of one thread
# keep two cores busy, where one process of two threads leaves them idle during every sleep, subprocess and Ray start.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if XDIST_WORKER else min(2, os.cpu_count() or 1))
# The suite chooses its threads (as above) for the runs it starts in this process and in children: lathe's own
# choice for a small CPU model (one thread, `lathe.device.cpu_threads`) would otherwise change them mid-suite.
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# Inductor compiles in a pool of worker processes, one per CPU, started in each process that compiles: on 2 cores
# already busy that pool costs more than it saves (tests/models/test_compile.py: 60 CPU-s with one compile thread
# against 75 with the pool, 2026-12-01), so the suite's compiles run in their own process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# lathe's cache (warm-started models, lathe.loop.warm_cache) lives in a directory of this session: runs in the suite
# share it, and nothing is read from or left in the user's ~/.cache/lathe.
# (xdist's workers share the one their controller made, so a warm start is computed once for all of them.)
if not (XDIST_WORKER and os.environ.get("LATHE_TEST_CACHE")):
    os.environ["LATHE_TEST_CACHE"] = os.environ["LATHE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lathe-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LATHE_CACHE_DIR"], ignore_errors=True)
os.environ["LATHE_CACHE_DIR"] = os.environ["LATHE_TEST_CACHE"]

# Without a GPU, Triton kernels (lathe.engine.triton_decode) run in Triton's interpreter. The switch is read
# when triton.language is imported, so it is set here, before any test imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that start ranks fork them from multiprocessing's forkserver: one server per process (xdist worker), started by
# the first such test with the modules that test asks it to preload; a later test's list is not read (the server runs
# on), so each of its ranks imports what the first list lacked (lathe's trainer and engine, FSDP, DCP: seconds of CPU
# a rank, for every rank of every later module). Every list therefore begins with the modules the ranks share.
FORKSERVER_PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                      "lathe.config", "lathe.models.decoder", "lathe.train.actor", "lathe.train.critic",
                      "lathe.engine.llm_engine", "lathe.workers.actor_rollout_ref")
_set_forkserver_preload = forkserver.set_forkserver_preload


def _preload_shared_modules_first(module_names):
    _set_forkserver_preload([*FORKSERVER_PRELOAD, *(m for m in module_names if m not in FORKSERVER_PRELOAD)])


forkserver.set_forkserver_preload = _preload_shared_modules_first     # (what context.set_forkserver_preload calls)

# Tests that start Ray clusters share one local cluster per xdist worker (tests/cluster/conftest.py), in two groups
# (`--dist loadgroup`) of about equal time: the fully-async modules, and the other cluster tests. As one group their
# chain (15 min on 2 cores, 2026-12-01) was longer than everything else on the other worker; as two, each worker starts
# a cluster of its own and runs one group beside the other (the clusters' CPU slots are logical: each holds 4, on any
# machine, and no test counts the machine's CPUs). Modules that start no Ray (marked `no_ray`) are left to either worker.
# Tests that run code in lathe's sandbox likewise share one worker: the sandbox's tests check that no sandboxed
# process or `lathe-sbx-*` directory outlives a run, which another worker's run at that moment would fail.
RAY_ASYNC = ("tests/cluster/test_fully_async.py", "tests/cluster/test_data_parallel_ray.py")
GROUPS = {"ray_async": RAY_ASYNC, "ray": ("tests/cluster/",),
          "sandbox": ("tests/reward/test_sandbox.py", "tests/rollout/agent/test_tools.py", "tests/test_examples.py",
                      "tests/test_report.py")}


# Modules whose module-scoped fixture spawns ranks or trains runs: each module's tests on one worker, so that the
# fixture runs once (xdist hands tests out one by one, and each worker that gets one of them builds the fixture).
ONE_WORKER = ("tests/train/test_expert_parallel.py", "tests/train/test_tensor_parallel.py",
              "tests/train/test_parallel.py", "tests/train/test_ulysses.py", "tests/engine/test_tensor_parallel.py",
              "tests/loop/test_sft.py", "tests/engine/test_deepseek_engine.py", "tests/models/test_deepseek.py",
              "tests/train/test_ulysses_hybrid.py", "tests/train/test_routing_ulysses.py",
              "tests/train/test_distillation_tp.py", "tests/train/test_expert_parallel_lora.py",
              "tests/workers/test_lockstep_agent.py", "tests/train/test_tp_ulysses.py",
              "tests/train/test_mtp_ulysses.py", "tests/train/test_tensor_parallel_lora.py",
              "tests/train/test_tp_ulysses_lora_mtp.py", "tests/train/test_tp_expert_parallel.py",
              "tests/train/test_offloaded_adamw.py", "tests/engine/test_data_parallel.py")


@pytest.hookimpl(tryfirst=True)    # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.as_posix()
        for group, paths in GROUPS.items():      # the first group that names the path (one group an item)
            if group.startswith("ray") and item.get_closest_marker("no_ray"):
                continue
            if any(f"/{p}" in path or path.endswith(p) for p in paths):
                item.add_marker(pytest.mark.xdist_group(group))
                break
        if path.endswith(ONE_WORKER):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
