"""lathe.ckpt.export on checkpoint layouts built by hand: which checkpoint it picks and every refusal with its fix.
(Exports of real checkpoints, full and sharded, loaded by transformers: tests/cluster/test_ray.py.)"""

from __future__ import annotations

import json

import pytest

from lathe.ckpt.export import export, find_checkpoint


def fake_run(root, steps=(2, 4), latest=4, files=("model.safetensors",), index=None):
    for step in steps:
        hf = root / f"global_step_{step}" / "actor" / "huggingface"
        hf.mkdir(parents=True)
        (root / f"global_step_{step}" / "trainer_state.pt").write_bytes(b"")
        (hf / "config.json").write_text("{}")
        for f in files:
            (hf / f).write_bytes(b"weights")
        if index is not None:
            (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    if latest is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(latest))
    return root


def test_the_latest_or_the_named_step_is_exported(tmp_path):
    run = fake_run(tmp_path / "run")
    assert find_checkpoint(run) == run / "global_step_4"
    assert find_checkpoint(run, step=2) == run / "global_step_2"
    assert find_checkpoint(run / "global_step_2") == run / "global_step_2"
    out = export(run, tmp_path / "out", step=2)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("setup,call,error,words", [
    (dict(latest=None), dict(), FileNotFoundError, "holds no latest_checkpointed_iteration.txt"),
    (dict(), dict(step=3), FileNotFoundError, "has no global_step_3 (it has [2, 4])"),
    (dict(), dict(part="critic"), FileNotFoundError, "has no critic (it has actor)"),
    (dict(), dict(part="reward"), ValueError, "use one of actor, critic"),
    (dict(files=("model-00001-of-00002.safetensors",), index={"a": "model-00001-of-00002.safetensors",
                                                             "b": "model-00002-of-00002.safetensors"}),
     dict(), FileNotFoundError, "lacks model-00002-of-00002.safetensors"),
])
def test_a_checkpoint_that_cannot_be_exported_is_refused_with_the_fix(tmp_path, setup, call, error, words):
    run = fake_run(tmp_path / "run", **setup)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        export(run, tmp_path / "out", **call)


def test_an_existing_output_is_replaced_only_with_force(tmp_path):
    run = fake_run(tmp_path / "run")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="--force"):
        export(run, tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").exists()
    export(run, tmp_path / "out", force=True)
    assert not (tmp_path / "out" / "mine.txt").exists() and (tmp_path / "out" / "config.json").exists()
