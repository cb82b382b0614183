import sys
import types

import pytest
import torch

from lathe.track import METRICS_FILE, Tracker, read_metrics
from lathe.track import backends
from lathe.track.backends import flatten_config, mlflow_key


def make(tmp_path, loggers, **kw):
    return Tracker(loggers, tmp_path, project="proj", experiment="exp/1", config={"trainer": {"n": 1}}, **kw)


def test_flatten_config_and_mlflow_key():
    assert flatten_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": [1, 2], "d": None}
    assert flatten_config(None) == {}
    assert mlflow_key("val-core/x/reward/best@4/mean") == "val-core/x/reward/best_at_4/mean"
    assert mlflow_key("a[b]:c") == "a_b_:c" and mlflow_key("/perf//mfu/") == "perf/mfu"   # as mlflow accepts them


def fake_module(name, calls, **funcs):
    mod = types.ModuleType(name)
    for fname, ret in funcs.items():
        def f(*args, _fname=fname, _ret=ret, **kwargs):
            calls.append((_fname, args, kwargs))
            return _ret(*args, **kwargs) if callable(_ret) else _ret
        setattr(mod, fname, f)
    return mod


def fake_wandb(calls):
    """A fake ``wandb`` whose ``init`` returns a run with ``log``/``finish`` recording into ``calls``."""
    run = fake_module("run", calls, log=None, finish=None)
    return fake_module("wandb", calls, init=run)


def test_wandb_init_log_finish(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    with make(tmp_path, ["wandb"]) as tr:
        tr.log({"actor/pg_loss": torch.tensor(0.5)}, 7)
    (n0, _, init), (n1, _, log_kw), (n2, _, _) = calls
    assert (n0, n1, n2) == ("init", "log", "finish")
    assert init["project"] == "proj" and init["name"] == "exp/1" and init["mode"] == "offline"
    assert init["config"] == {"trainer": {"n": 1}} and init["id"] == "proj--exp-1" and init["dir"] == str(tmp_path)
    assert calls[1][1] == ({"actor/pg_loss": 0.5},) and log_kw == {"step": 7}


def test_remote_logger_failure_warns_and_run_continues(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise ConnectionError("network down")

    run = fake_module("run", [], log=boom, finish=None)
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", [], init=run))
    with make(tmp_path, ["wandb"]) as tr:
        with pytest.warns(UserWarning, match="'wandb' failed at step 1"):
            tr.log({"a": 1.0}, 1)
        tr.log({"a": 2.0}, 2)  # warned once, still logs to jsonl
    assert [r["a"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1.0, 2.0]


def fake_mlflow(calls, **funcs):
    """A fake ``mlflow``: experiment "42", a new run that holds no params."""
    run = types.SimpleNamespace(data=types.SimpleNamespace(params={}))
    return fake_module("mlflow", calls, set_tracking_uri=None, get_experiment_by_name=None, create_experiment="42",
                       set_experiment=types.SimpleNamespace(experiment_id="42"), start_run=run, log_params=None,
                       end_run=None, **funcs)


def test_mlflow_params_and_metric_names(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(backends, "_require_sqlalchemy", lambda uri: None)   # (the fake needs no SQLAlchemy)
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls, log_metrics=None))
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    with make(tmp_path, ["mlflow"]) as tr:
        tr.log({"val-core/gsm8k/reward/mean@1": 0.5}, 3)
    by_name = {name: (args, kw) for name, args, kw in calls}
    assert by_name["set_tracking_uri"][0][0] == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    artifacts = (tmp_path.resolve() / "mlartifacts").as_uri()   # not mlflow's ./mlruns of the working directory
    assert by_name["create_experiment"] == (("proj",), {"artifact_location": artifacts})
    assert by_name["set_experiment"][0] == ("proj",)
    assert by_name["start_run"][1] == {"experiment_id": "42", "run_name": "exp/1"}
    assert by_name["log_params"][0] == ({"trainer/n": "1"},)   # verl's param names
    assert by_name["log_metrics"] == (({"val-core/gsm8k/reward/mean_at_1": 0.5},), {"step": 3})
    assert [c[0] for c in calls][-1] == "end_run"


SAMPLES = [("1+1=", "2", 1.0), ("2+2=", "5", 0.0)]


def test_generations_go_to_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with make(tmp_path, ["console", "tensorboard"]) as tr:
        tr.log_generations(SAMPLES, 4)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "**Input:** 2+2=" in text and "**Output:** 5" in text and "**Score:** 0.0" in text


def test_generations_go_to_wandb_as_a_growing_table_and_to_mlflow_as_json(tmp_path, monkeypatch):
    calls = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    sys.modules["wandb"].Table = Table
    with make(tmp_path, ["wandb"]) as tr:
        tr.log_generations(SAMPLES[:1], 2)
        tr.log_generations(SAMPLES, 4)
    table = [kw for name, args, kw in calls if name == "log"][-1]
    logged = [args[0]["val/generations"] for name, args, kw in calls if name == "log"][-1]
    assert table == {"step": 4} and logged.columns[:4] == ["step", "input_1", "output_1", "score_1"]
    assert logged.data == [[2, "1+1=", "2", 1.0, None, None, None], [4, "1+1=", "2", 1.0, "2+2=", "5", 0.0]]
    calls.clear()
    monkeypatch.setattr(backends, "_require_sqlalchemy", lambda uri: None)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls, log_dict=None))
    with make(tmp_path, ["mlflow"]) as tr:
        tr.log_generations(SAMPLES, 4)
    (args,) = [a for name, a, kw in calls if name == "log_dict"]
    assert args == ([{"input": "1+1=", "output": "2", "score": 1.0}, {"input": "2+2=", "output": "5", "score": 0.0}],
                    "val_step4.json")   # verl's artifact name
