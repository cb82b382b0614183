"""lathe.loop.setup: the warm start a person can follow."""

from __future__ import annotations

import io
import logging
import os
import re

import torch

from lathe.cli.output import quiet_libraries
from lathe.config import load_config
from lathe.loop.setup import build_model, load_datasets
from lathe.models.hf import load_tokenizer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_warm_start_shows_its_progress_and_no_third_party_bar(tmp_path, monkeypatch, caplog):
    from transformers.utils import logging as transformers_logging
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)    # as in a fresh process, until ...
    quiet_libraries()                                                  # ... `lathe` quietens it
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    cfg = load_config("default", ["actor_rollout_ref.model.warm_start.steps=3",
                                  "actor_rollout_ref.model.warm_start.cache=false",     # trained here, not read back
                                  f"trainer.default_local_dir={tmp_path}"])
    tokenizer = load_tokenizer("builtin:tiny")
    with caplog.at_level(logging.INFO, logger="lathe"):
        build_model(cfg, tokenizer, load_datasets(cfg, tokenizer)[0], tmp_path, None, torch.device("cpu"))
    shown = term.getvalue()
    assert re.search(r"\rwarm start 1/3 33% \| [^|]+ \| eta [^|]+ \| loss \d\.\d\d\d", shown), shown
    assert "\rwarm start 3/3 100%" in shown and "Writing model shards" not in shown
    assert "warm start: 3 supervised steps on extra_info.answer" in caplog.text
    assert re.search(r"warm start: 3 steps in \S+, loss \d\.\d{3} -> \d\.\d{3}", caplog.text)
    assert (tmp_path / "init_model" / "config.json").exists()
