import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# The suite chooses its threads (two, as above) for the runs it starts in this process and in children: lathe's own
# choice for a small CPU model (one thread, `lathe.device.cpu_threads`) would otherwise change them mid-suite.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

# lathe's cache (warm-started models, lathe.loop.warm_cache) lives in a directory of this session: runs in the suite
# share it, and nothing is read from or left in the user's ~/.cache/lathe.
os.environ["LATHE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lathe-test-cache-")
atexit.register(shutil.rmtree, os.environ["LATHE_CACHE_DIR"], ignore_errors=True)

# Without a GPU, Triton kernels (lathe.engine.triton_decode) run in Triton's interpreter. The switch is read
# when triton.language is imported, so it is set here, before any test imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
