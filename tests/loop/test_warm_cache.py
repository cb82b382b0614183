"""The warm-start cache (lathe/loop/warm_cache.py): the same inputs read the same model back; other inputs, a
damaged entry or `warm_start.cache=false` train again."""

from __future__ import annotations

import logging

import pytest
import torch

from lathe.config import load_config
from lathe.loop import warm_cache, warm_start
from lathe.loop.setup import build_model, load_datasets
from lathe.models.hf import load_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = warm_start.supervised_fit
    monkeypatch.setattr(warm_start, "supervised_fit", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def warm(tmp_path, name: str, *overrides: str):
    run_dir = tmp_path / name
    cfg = load_config("default", ["actor_rollout_ref.model.warm_start.steps=3", "data.max_prompt_length=16",
                                  f"trainer.default_local_dir={run_dir}", *overrides])
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_model(cfg, tokenizer, load_datasets(cfg, tokenizer)[0], run_dir, None, torch.device("cpu"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def entries(tmp_path) -> list:
    root = tmp_path / "cache" / "warm_start"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def test_the_same_inputs_read_the_same_model_from_the_cache(tmp_path, cache, caplog):
    first = warm(tmp_path, "a")
    with caplog.at_level(logging.INFO, logger="lathe"):
        second = warm(tmp_path, "b")
    assert len(cache) == 1 and len(entries(tmp_path)) == 1
    assert "read from the cache" in caplog.text
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert (tmp_path / "b" / "init_model" / "config.json").exists()     # resume and the reference read it there


def test_other_inputs_train_again(tmp_path, cache):
    warm(tmp_path, "a")
    warm(tmp_path, "b", "actor_rollout_ref.model.warm_start.lr=5e-4")
    warm(tmp_path, "c", "trainer.seed=7")
    assert len(cache) == 3 and len(entries(tmp_path)) == 3


def test_a_damaged_entry_is_dropped_and_trained_again(tmp_path, cache, caplog):
    first = warm(tmp_path, "a")
    (entry,) = entries(tmp_path)
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lathe"):
        second = warm(tmp_path, "b")
    assert len(cache) == 2 and "model.safetensors" in caplog.text and "training again" in caplog.text
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert warm_cache.verify(entry)                                 # stored again, whole


def test_cache_false_neither_reads_nor_writes(tmp_path, cache):
    warm(tmp_path, "a")
    warm(tmp_path, "b", "actor_rollout_ref.model.warm_start.cache=false")
    warm(tmp_path, "c", "actor_rollout_ref.model.warm_start.cache=false", "trainer.seed=3")
    assert len(cache) == 3 and len(entries(tmp_path)) == 1


def test_an_unwritable_cache_costs_a_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path / "file" / "below"))
    with caplog.at_level(logging.WARNING, logger="lathe"):
        warm(tmp_path, "a")
    assert "could not write" in caplog.text and "LATHE_CACHE_DIR" in caplog.text
