"""Tests for lathe.ckpt.checkpoint: layout, latest marker, pruning, resume selection and RNG round trips."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lathe.ckpt.checkpoint import (LATEST, capture_rng, find_resume_dir, load_trainer_state, restore_rng,
                                   save_checkpoint, step_dir)


class FakeWorker:
    """Writes a small file per save; `fail_at` makes the save of that step raise midway."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.saved = []

    def save_checkpoint(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "weights.txt").write_text(str(path))
        if self.fail_at is not None and f"global_step_{self.fail_at}." in path.parent.name + ".":
            raise RuntimeError("disk full")
        self.saved.append(path)


def _trainer(root, mode="auto", resume_from_path=None, fallback=False):
    return SimpleNamespace(resume_mode=mode, resume_from_path=resume_from_path, default_local_dir=str(root),
                           resume_fallback_to_verified=fallback)


def _steps(root):
    return sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*"))


def test_save_layout_and_trainer_state(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"actor": FakeWorker()}, {"dataloader": {"epoch": 1, "index": 5}})
    assert path == step_dir(tmp_path, 3) == tmp_path / "global_step_3"
    assert (path / "actor" / "weights.txt").exists()
    assert (tmp_path / LATEST).read_text() == "3"
    state = load_trainer_state(path)
    assert state["global_step"] == 3 and state["dataloader"] == {"epoch": 1, "index": 5}
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    assert not (tmp_path / (LATEST + ".tmp")).exists()


def test_latest_and_prune_with_max_to_keep(tmp_path):
    worker = FakeWorker()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"actor": worker}, {}, max_to_keep=2)
    assert _steps(tmp_path) == [4, 5]
    assert find_resume_dir(_trainer(tmp_path)) == tmp_path / "global_step_5"


def test_no_pruning_without_max_to_keep(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"actor": FakeWorker()}, {}, max_to_keep=None)
    assert _steps(tmp_path) == [10, 20, 30]
    assert find_resume_dir(_trainer(tmp_path)) == tmp_path / "global_step_30"


def test_prune_orders_steps_numerically(tmp_path):
    for step in (9, 10, 100):
        save_checkpoint(tmp_path, step, {"actor": FakeWorker()}, {}, max_to_keep=2)
    assert _steps(tmp_path) == [10, 100]


def test_trainer_state_loads_without_pickled_code(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {"dataloader": {"epoch": 0}})
    torch.load(step_dir(tmp_path, 1) / "trainer_state.pt", weights_only=True)    # no unpickling of objects


def test_resave_of_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 2, {"actor": FakeWorker()}, {"v": 1})
    (step_dir(tmp_path, 2) / "stale.txt").write_text("old")
    save_checkpoint(tmp_path, 2, {"actor": FakeWorker()}, {"v": 2})
    assert not (step_dir(tmp_path, 2) / "stale.txt").exists()
    assert load_trainer_state(step_dir(tmp_path, 2))["v"] == 2


@pytest.mark.parametrize("failing", ["actor", "critic"])
def test_save_cut_short_leaves_the_previous_checkpoint_latest_and_whole(tmp_path, failing):
    """A failure in any part (the critic is written after the actor) leaves no global_step_2 at all."""
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker(), "critic": FakeWorker()}, {"v": 1}, max_to_keep=1)
    parts = {"actor": FakeWorker(fail_at=2 if failing == "actor" else None),
             "critic": FakeWorker(fail_at=2 if failing == "critic" else None)}
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, parts, {"v": 2}, max_to_keep=1)
    assert not step_dir(tmp_path, 2).exists() and _steps(tmp_path) == [1]
    assert find_resume_dir(_trainer(tmp_path)) == step_dir(tmp_path, 1)
    assert load_trainer_state(step_dir(tmp_path, 1))["v"] == 1
    assert (step_dir(tmp_path, 1) / "critic" / "weights.txt").exists()
    save_checkpoint(tmp_path, 2, {"actor": FakeWorker(), "critic": FakeWorker()}, {"v": 2}, max_to_keep=1)
    assert _steps(tmp_path) == [2] and not list(tmp_path.glob(".global_step_*"))   # the retry cleans up


def test_partial_step_dir_with_higher_number_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 4, {"actor": FakeWorker()}, {})
    (step_dir(tmp_path, 8) / "actor").mkdir(parents=True)      # e.g. a crash before trainer_state.pt
    assert find_resume_dir(_trainer(tmp_path)) == step_dir(tmp_path, 4)


def test_prune_never_deletes_the_checkpoint_just_saved(tmp_path):
    # Resuming from an older checkpoint into the same folder: later steps from the abandoned run exist.
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"actor": FakeWorker()}, {})
    path = save_checkpoint(tmp_path, 2, {"actor": FakeWorker()}, {"branch": "new"}, max_to_keep=2)
    assert (path / "trainer_state.pt").exists()
    assert find_resume_dir(_trainer(tmp_path)) == path
    assert load_trainer_state(path)["branch"] == "new"
    assert _steps(tmp_path) == [1, 2, 3, 4]      # older ones pruned up to max_to_keep; later ones left alone


def test_auto_without_checkpoints_and_disable(tmp_path):
    assert find_resume_dir(_trainer(tmp_path / "fresh")) is None
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {})
    assert find_resume_dir(_trainer(tmp_path, mode="disable")) is None


def test_latest_marker_naming_a_missing_step_is_an_error(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {})
    (tmp_path / LATEST).write_text("7")
    with pytest.raises(FileNotFoundError, match="global_step_7") as err:
        find_resume_dir(_trainer(tmp_path))
    assert "resume_mode=resume_path" in str(err.value)


def test_resume_path(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {})
    save_checkpoint(tmp_path, 2, {"actor": FakeWorker()}, {})
    chosen = find_resume_dir(_trainer(tmp_path, "resume_path", str(step_dir(tmp_path, 1))))
    assert chosen == step_dir(tmp_path, 1)


@pytest.mark.parametrize("target", ["missing", "root", "actor_only"])
def test_resume_path_errors_name_the_key(tmp_path, target):
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {})
    (step_dir(tmp_path, 2) / "actor").mkdir(parents=True)
    path = {"missing": tmp_path / "nope", "root": tmp_path, "actor_only": step_dir(tmp_path, 2)}[target]
    with pytest.raises(FileNotFoundError, match="trainer.resume_from_path") as err:
        find_resume_dir(_trainer(tmp_path, "resume_path", str(path)))
    assert "trainer_state.pt" in str(err.value)


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_capture_restore_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    state = capture_rng()
    first = _draw()
    _draw()
    restore_rng(state)
    assert _draw() == first


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    save_checkpoint(tmp_path, 1, {"actor": FakeWorker()}, {})
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(load_trainer_state(step_dir(tmp_path, 1))["rng"])
    assert _draw() == expected
