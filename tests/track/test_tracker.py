import json
import re
import sys

import pytest
import torch

from lathe.track import METRICS_FILE, VALID_LOGGERS, Tracker, read_metrics


def make(tmp_path, loggers, **kw):
    return Tracker(loggers, tmp_path, project="proj", experiment="exp/1", config={"trainer": {"n": 1}}, **kw)


def test_jsonl_always_written_with_plain_numbers(tmp_path):
    with make(tmp_path, []) as tr:
        logged = tr.log({"actor/pg_loss": torch.tensor(-0.5), "perf/total_num_tokens": 128}, step=1)
        assert logged == {"actor/pg_loss": -0.5, "perf/total_num_tokens": 128}
    text = (tmp_path / METRICS_FILE).read_text()
    assert json.loads(text) == {"step": 1, "actor/pg_loss": -0.5, "perf/total_num_tokens": 128}


def test_resume_truncates_jsonl(tmp_path):
    with make(tmp_path, ["jsonl"]) as tr:
        for s in range(1, 7):
            tr.log({"critic/score/mean": s / 10}, s)
    with make(tmp_path, ["jsonl"]) as tr:
        assert tr.truncate_after(4) == 2
        tr.log({"critic/score/mean": 0.99}, 5)
    recs = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and recs[-1]["critic/score/mean"] == 0.99


def test_console_line_printed_and_routable(tmp_path, capsys):
    with make(tmp_path, ["console"], total_steps=10) as tr:
        tr.log({"critic/score/mean": 0.25, "timing_s/step": 1.0}, 2)
    out = capsys.readouterr().out               # HH:MM:SS, the line, the ETA of the 8 steps left
    assert re.fullmatch(r"\d\d:\d\d:\d\d step 2/10 \| score 0.25 \| step 1.00s \| eta \S+\n", out), out
    got = []
    with make(tmp_path, "console", printer=got.append) as tr:
        tr.log({"actor/pg_loss": 0.1}, 3)
    assert got == ["step 3 | pg_loss 0.1"]


def test_unknown_logger_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        make(tmp_path, ["console", "tensorbord"])
    msg = str(err.value)
    assert "'tensorbord'" in msg and "did you mean 'tensorboard'" in msg
    assert all(name in msg for name in VALID_LOGGERS)


def test_wandb_named_but_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        make(tmp_path, ["console", "wandb"])


def test_mlflow_named_but_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match="pip install mlflow"):
        make(tmp_path, ["mlflow"])


def test_non_numeric_metric_dropped_with_warning(tmp_path):
    with make(tmp_path, []) as tr:
        with pytest.warns(UserWarning, match="'val/generations'"):
            tr.log({"val/generations": "some text", "a": 1.0}, 1)
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 1, "a": 1.0}]


def test_bad_step_rejected(tmp_path):
    with make(tmp_path, []) as tr:
        with pytest.raises(ValueError, match="step"):
            tr.log({"a": 1.0}, step=-1)
        with pytest.raises(ValueError, match="step"):
            tr.log({"a": 1.0}, step=1.5)


def test_tensorboard_events_readable_and_purged_on_resume(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with make(tmp_path, ["tensorboard"]) as tr:
        for s in range(1, 6):
            tr.log({"critic/score/mean": float(s), "timing_s/gen": torch.tensor(0.5)}, s)
    with make(tmp_path, ["tensorboard"]) as tr:
        tr.truncate_after(3)
        tr.log({"critic/score/mean": 40.0}, 4)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"critic/score/mean", "timing_s/gen"} <= set(acc.Tags()["scalars"])
    points = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
