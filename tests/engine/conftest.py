"""Tiny random checkpoints of each family (saved with transformers, loaded with `load_lathe_model`)."""

import pytest

from models.lathe_tiny import FAMILIES, save_hf


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (path, transformers model)} made once per session."""
    root = tmp_path_factory.mktemp("engine-ckpt")
    return {f: save_hf(root, f) for f in FAMILIES}


# Ragged prompts; two share a 9-token prefix (more than two blocks of 4) so prefix caching has work to do.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 42, 43, 44],
           [20, 21, 22, 23, 24, 25, 26]]
