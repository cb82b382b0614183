"""Tiny random checkpoints of each family (saved with transformers, loaded with `load_lathe_model`)."""

import numpy as np
import pytest
import torch

from models.lathe_tiny import FAMILIES, save_hf


@pytest.fixture(scope="module")
def triton_interpreter():
    """Triton kernels run by Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
    imported when there is no GPU); skips on a GPU machine, where bench/ and the gpu tests run them for real."""
    pytest.importorskip("triton", reason="triton is not installed")
    from lathe.engine import triton_decode
    if torch.cuda.is_available() or not triton_decode.interpreted():
        pytest.skip("runs in Triton's CPU interpreter; GPU kernels are exercised by bench/ and the gpu tests")
    import triton.runtime.interpreter as interp
    old_patch = interp._patch_lang_tensor

    def patch(tensor, scope):   # numpy >= 2.4 refuses int() of a size-1 array, which the interpreter relies on
        old_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    yield
    interp._patch_lang_tensor = old_patch


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (path, transformers model)} made once per session."""
    root = tmp_path_factory.mktemp("engine-ckpt")
    return {f: save_hf(root, f) for f in FAMILIES}


# Ragged prompts; two share a 9-token prefix (more than two blocks of 4) so prefix caching has work to do.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 42, 43, 44],
           [20, 21, 22, 23, 24, 25, 26]]
