"""The wandb and mlflow loggers against the real packages, offline: W&B in offline mode (read back from the run's
``.wandb`` transaction log), MLflow with a local store (sqlite, lathe's default, and ``file:``), each checked for
the config, the metric history at its steps and the validation generations where a verl user looks for them;
then one `lathe train` run logging to both. No network, no login."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from lathe.track import METRICS_FILE, Tracker, read_metrics

CONFIG = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-6}}},
          "trainer": {"logger": ["console", "wandb"], "project_name": "proj"}, "data": {"prompt_key": None}}
STEPS = {1: {"critic/score/mean": 0.25, "val-core/gsm8k/reward/mean@1": 0.5, "timing_s/gen": 1.5},
         2: {"critic/score/mean": 0.5, "actor/pg_loss": -0.125},
         3: {"critic/score/mean": 0.75, "val-core/gsm8k/reward/mean@1": 1.0, "response_length/mean": 7}}
SAMPLES = [("1+1=", "2", 1.0), ("2+2=", "5", 0)]   # an int score among floats, as a reward function may return


def log_run(tmp_path: Path, loggers: list[str], steps=STEPS, generations=(1, 3)) -> Path:
    """One Tracker (project "proj", experiment "exp/1") logging `steps` and, at `generations`, a samples table."""
    with Tracker(loggers, tmp_path, project="proj", experiment="exp/1", config=CONFIG) as tr:
        for step, metrics in steps.items():
            if step in generations:
                tr.log_generations(SAMPLES[: 1 + (step > 1)], step)   # the table grows: 1 sample, then 2
            tr.log(metrics, step)
    return tmp_path


# --- W&B offline --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wandb_service():
    """The module's tests share one wandb-core service process (each start costs ~1 s); it is stopped at the end."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    yield wandb
    wandb.teardown()


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch, wandb_service):
    """W&B offline: no network, no login, no console capture or system stats (they cost start-up); the run's files
    under run_dir/wandb (lathe's default), wandb's own settings and caches under tmp_path."""
    wandb = wandb_service
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):   # files: run_dir/wandb
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    return wandb


def wandb_records(path: Path):
    """The records of a ``.wandb`` transaction log: a 7-byte header, then 32 KiB blocks of LevelDB-log chunks
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:                      # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if len(chunk) < length:                          # the writer is still at it: the records so far
            return
        if kind == 0:                                    # zero fill up to the block's end
            pos += -pos % block
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def finished_records(log: Path, timeout_s: float = 10.0) -> list:
    """The records of a finished run's log: wandb-core writes the file a moment after ``finish()`` returns."""
    from google.protobuf.message import DecodeError
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(log))
        except DecodeError:                              # read while a record was half written: read again
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.02)


def read_wandb_run(log: Path) -> dict:
    """id, config, history ({step: {key: value}}) and files dir of the offline run whose log is ``log``."""
    out: dict = {"dir": log.parent / "files", "config": {}, "history": {}}
    for rec in finished_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["project"], out["name"] = rec.run.run_id, rec.run.project, rec.run.display_name
        if kind in ("run", "config"):
            updates = rec.run.config.update if kind == "run" else rec.config.update
            out["config"].update({u.key: json.loads(u.value_json) for u in updates})
        if kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            out["history"][rec.history.step.num] = row
    return out


def test_wandb_offline_run_holds_config_metrics_and_generations_table(tmp_path, wandb_offline):
    log_run(tmp_path, ["wandb"])
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run = read_wandb_run(log)
    assert (run["id"], run["project"], run["name"]) == ("proj--exp-1", "proj", "exp/1")
    assert run["config"]["actor_rollout_ref"] == CONFIG["actor_rollout_ref"]
    assert run["config"]["trainer"]["logger"] == ["console", "wandb"] and run["config"]["data"] == {"prompt_key": None}
    for step, metrics in STEPS.items():
        row = run["history"][step]
        assert row["_step"] == step and {k: row[k] for k in metrics} == metrics, step
    table = run["history"][3]["val/generations/path"]   # verl's key; the table file holds every validation's row
    assert run["history"][3]["val/generations/_type"] == "table-file"
    data = json.loads((run["dir"] / table).read_text())
    assert data["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert data["data"] == [[1, "1+1=", "2", 1.0, None, None, None], [3, "1+1=", "2", 1.0, "2+2=", "5", 0]]


def test_wandb_resume_continues_the_same_run_id(tmp_path, wandb_offline):
    log_run(tmp_path / "a", ["wandb"], steps={1: STEPS[1], 2: STEPS[2]}, generations=())
    with Tracker(["wandb"], tmp_path / "a", project="proj", experiment="exp/1", config=CONFIG) as tr:
        tr.truncate_after(1)
        tr.log(STEPS[2], 2)
        tr.log(STEPS[3], 3)
    logs = sorted((tmp_path / "a" / "wandb").glob("offline-run-*/run-*.wandb"))   # offline-run-<time>-<id>[-1]
    assert len(logs) == 2   # offline, each start writes a directory; `wandb sync` puts both into the one run id
    first, resumed = (read_wandb_run(log) for log in logs)
    assert first["id"] == resumed["id"] == "proj--exp-1" and sorted(resumed["history"]) == [2, 3]
    assert [r.run.resume for r in finished_records(logs[1]) if r.WhichOneof("record_type") == "run"] == [True]


# --- MLflow, local stores -----------------------------------------------------------------------------------------

@pytest.fixture
def mlflow_local(monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow)")
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(key, raising=False)
    return mlflow


@pytest.fixture(scope="module")
def empty_mlflow_db(tmp_path_factory) -> Path:
    """An mlflow sqlite store with its tables and no experiment: creating one runs mlflow's schema migrations
    (4-7 s on two cores), so the module does it once and each test starts from a copy."""
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow)")
    pytest.importorskip("sqlalchemy", reason="mlflow's sqlite store needs SQLAlchemy (pip install mlflow)")
    from mlflow.tracking import MlflowClient
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def lathe_default_store(run_dir: Path, empty_db: Path) -> str:
    """Where lathe's mlflow logger puts a run without MLFLOW_TRACKING_URI, seeded with the module's empty store."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty_db, run_dir / "mlflow.db")
    return f"sqlite:///{run_dir / 'mlflow.db'}"


def mlflow_runs(mlflow, uri: str, experiment: str = "proj") -> tuple:
    """A client of the store at ``uri`` and the experiment's runs, oldest first."""
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def check_mlflow_run(client, run, steps=STEPS, generations=(1, 3)) -> None:
    """params (verl's ``/``-joined config keys), metric history at its steps (``@`` -> ``_at_``), samples JSON."""
    assert run.info.run_name == "exp/1" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["actor_rollout_ref/actor/ppo_mini_batch_size"] == "2"
    assert params["actor_rollout_ref/actor/optim/lr"] == "1e-06" and params["data/prompt_key"] == "None"
    assert params["trainer/logger"] == "['console', 'wandb']"
    for key in ("critic/score/mean", "val-core/gsm8k/reward/mean@1", "response_length/mean"):
        history = client.get_metric_history(run.info.run_id, key.replace("@", "_at_"))
        want = [(s, float(m[key])) for s, m in steps.items() if key in m]
        assert sorted((m.step, m.value) for m in history) == want, key
    local = Path(client.download_artifacts(run.info.run_id, ""))
    assert sorted(p.name for p in local.iterdir()) == [f"val_step{s}.json" for s in generations]
    if 3 in generations:
        assert json.loads((local / "val_step3.json").read_text()) == [
            {"input": "1+1=", "output": "2", "score": 1.0}, {"input": "2+2=", "output": "5", "score": 0}]


def test_mlflow_default_sqlite_store_and_resume(tmp_path, mlflow_local, empty_mlflow_db, monkeypatch):
    monkeypatch.chdir(tmp_path)   # mlflow's own artifact default would be ./mlruns: lathe's must not land there
    run_dir = tmp_path / "run"
    uri = lathe_default_store(run_dir, empty_mlflow_db)
    log_run(run_dir, ["mlflow"], steps={1: STEPS[1], 2: STEPS[2]}, generations=(1,))
    with Tracker(["mlflow"], run_dir, project="proj", experiment="exp/1", config=CONFIG) as tr:   # the resume
        tr.truncate_after(1)
        tr.log_generations(SAMPLES, 3)
        for step in (2, 3):
            tr.log(STEPS[step], step)
    assert not (tmp_path / "mlruns").exists()
    client, runs = mlflow_runs(mlflow_local, uri)
    assert len(runs) == 2   # as in verl, each start opens a new run of the experiment's name
    check_mlflow_run(client, runs[0], steps={1: STEPS[1], 2: STEPS[2]}, generations=(1,))
    check_mlflow_run(client, runs[1], steps={2: STEPS[2], 3: STEPS[3]}, generations=(3,))
    assert Path(runs[0].info.artifact_uri.removeprefix("file://")).is_relative_to(run_dir.resolve())


def test_mlflow_file_store_and_attach_by_run_id(tmp_path, mlflow_local, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # mlflow >= 3.7 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    log_run(tmp_path, ["mlflow"])
    client, (run,) = mlflow_runs(mlflow_local, uri)
    check_mlflow_run(client, run)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)   # attach (e.g. a platform's run): params already there
    changed = {**CONFIG, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}}
    with (pytest.warns(UserWarning, match="actor_rollout_ref/actor/ppo_mini_batch_size"),
          Tracker(["mlflow"], tmp_path, project="proj", experiment="exp/1", config=changed) as tr):
        tr.log({"critic/score/mean": 1.0}, 4)
    client, (run,) = mlflow_runs(mlflow_local, uri)
    assert run.data.params["actor_rollout_ref/actor/ppo_mini_batch_size"] == "2"   # mlflow keeps the first value
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3, 4]


def test_sqlite_store_without_sqlalchemy_says_what_to_install(tmp_path, mlflow_local, monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)   # mlflow-skinny alone: no SQLAlchemy
    with pytest.raises(ImportError, match=r"pip install mlflow"):
        Tracker(["mlflow"], tmp_path, project="proj", experiment="exp", config=None)


# --- one real run ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_lathe_train_logs_to_wandb_and_mlflow(tmp_path, wandb_offline, mlflow_local, empty_mlflow_db, monkeypatch):
    """The built-in run, 2 steps of 2 prompts x 2 responses of 2 tokens, validating on 4 prompts at each step."""
    from lathe.cli import main
    from lathe.data.builtin import arithmetic_rows
    monkeypatch.chdir(tmp_path)
    run_dir, val = tmp_path / "run", tmp_path / "val.jsonl"
    uri = lathe_default_store(run_dir, empty_mlflow_db)
    val.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_rows(4, seed=1, split="val", max_operand=9)))
    assert main(["train", "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.log_val_generations=2",
                 "trainer.val_before_train=false", "trainer.logger=[console,wandb,mlflow]",
                 "trainer.project_name=proj", "trainer.experiment_name=exp", f"trainer.default_local_dir={run_dir}",
                 "actor_rollout_ref.model.warm_start.steps=0", "data.train_batch_size=2",
                 "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "data.max_response_length=2", f"data.val_files={val}"]) == 0
    rows = {r["step"]: r for r in read_metrics(run_dir / METRICS_FILE)}
    assert sorted(rows) == [1, 2]
    keys = ("critic/score/mean", "actor/pg_loss", "val-core/lathe/arithmetic/reward/mean@1")
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    wb = read_wandb_run(log)
    assert wb["id"] == "proj--exp" and wb["config"]["data"]["train_batch_size"] == 2
    for step in (1, 2):
        assert {k: wb["history"][step][k] for k in keys} == {k: rows[step][k] for k in keys}
    table = json.loads((wb["dir"] / wb["history"][2]["val/generations/path"]).read_text())
    assert [row[0] for row in table["data"]] == [1, 2] and len(table["columns"]) == 1 + 2 * 3
    client, (run,) = mlflow_runs(mlflow_local, uri)
    assert run.data.params["data/train_batch_size"] == "2" and run.info.run_name == "exp"
    for key in keys:
        history = client.get_metric_history(run.info.run_id, key.replace("@", "_at_"))
        assert sorted((m.step, m.value) for m in history) == [(s, rows[s][key]) for s in (1, 2)], key
    local = Path(client.download_artifacts(run.info.run_id, ""))
    assert sorted(p.name for p in local.iterdir()) == ["val_step1.json", "val_step2.json"]
    assert len(json.loads((local / "val_step2.json").read_text())) == 2
