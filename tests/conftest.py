import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

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
