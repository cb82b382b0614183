"""The train tests' tiny models, configs and rollout batches serve the worker tests too."""

from train.conftest import load_cfg, make_lathe, make_model, rollout_batch  # noqa: F401
