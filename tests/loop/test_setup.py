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


def test_the_policy_starts_from_the_actors_megatron_checkpoint(tmp_path):
    from models.lathe_tiny import hf_model
    from models.megatron_writer import save_megatron
    hf = hf_model("qwen2", seed=4)
    hf.save_pretrained(tmp_path / "hf")
    mcore = save_megatron(hf, tmp_path / "mcore", stacked=True)
    norm = hf.model.norm.weight.detach().clone()
    with torch.no_grad():           # model.path's weights now differ from the checkpoint's, which the run starts from
        hf.model.norm.weight.add_(1.0)
    hf.save_pretrained(tmp_path / "hf")
    megatron = [f"actor_rollout_ref.{role}.megatron.{k}" for role in ("actor", "ref")
                for k in ("use_dist_checkpointing=true", f"dist_checkpointing_path={mcore}")]
    paths = [f"actor_rollout_ref.model.path={tmp_path / 'hf'}", f"trainer.default_local_dir={tmp_path}"]
    cfg = load_config("base", [*paths, "actor_rollout_ref.actor.use_kl_loss=true", *megatron])
    model = build_model(cfg, load_tokenizer("builtin:tiny"), None, tmp_path, None, torch.device("cpu"))
    assert torch.equal(model.model.norm.weight, norm)
    assert torch.equal(model.model.layers[1].self_attn.k_proj.bias, hf.model.layers[1].self_attn.k_proj.bias)
