"""Logger backends behind ``trainer.logger``: console, tensorboard, wandb, mlflow.

Each backend has ``log(metrics, step)`` taking plain numbers (the ``Tracker`` converts tensors
first), ``log_generations(samples, step)`` for verl's ``trainer.log_val_generations`` (``samples``: a list
of (input, output, score)), ``truncate_after(step)`` for resume, and ``close()``. wandb and mlflow are optional
dependencies: they are imported only when named, and a missing one is reported with the
``pip install`` that fixes it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lathe.track.console import format_step_line
from lathe.track.progress import echo, eta_seconds, stamp

__all__ = ["ConsoleLogger", "TensorboardLogger", "WandbLogger", "MlflowLogger", "import_optional"]

Metrics = Mapping[str, float | int]
Samples = list[tuple[str, str, float]]
GENERATIONS_KEY = "val/generations"


def import_optional(name: str) -> Any:
    """Import the optional package behind logger ``name``, or say exactly how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"trainer.logger names {name!r} but the {name} package is not installed ({err}). "
            f"Fix: `pip install {name}` (or `pip install lathe[{name}]`), or remove {name!r} from trainer.logger."
        ) from None


def plain(obj: Any) -> Any:
    """``obj`` as JSON-like data: dataclasses to dicts, paths to str, enums to their value."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def flatten_config(config: Any, sep: str = ".") -> dict[str, Any]:
    """Nested config as ``{"actor_rollout_ref.actor.ppo_mini_batch_size": 256, ...}`` (for mlflow params)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}{sep}{k}" if prefix else str(k))
        else:
            out[prefix or "config"] = node

    if config is not None:
        walk(plain(config), "")
    return out


def _default_printer(line: str) -> None:
    """``HH:MM:SS line`` on stdout, above the live progress line when there is one."""
    echo(f"{stamp()} {line}")


class ConsoleLogger:
    """One ``format_step_line`` per step, to stdout or to any ``printer`` (e.g. a logging method), with the ETA
    of ``total_steps`` at the mean pace since the logger opened, the step ``truncate_after`` resumed, or the
    validation logged at that step."""

    def __init__(self, total_steps: int | None = None, printer: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps = total_steps
        self.printer = printer or _default_printer
        self.clock = clock
        self.first_step, self.start = 0, clock()

    def log(self, metrics: Metrics, step: int) -> None:
        if step <= self.first_step:             # validation before training: the pace starts after it
            self.start = self.clock()
        total = None if self.total_steps is None else self.total_steps - self.first_step
        eta = eta_seconds(step - self.first_step, total, self.clock() - self.start)
        self.printer(format_step_line(step, self.total_steps, metrics, eta if step < (self.total_steps or 0) else None))

    def log_generations(self, samples: Samples, step: int) -> None:
        pass  # as in verl: sample tables go to the experiment loggers, not the step line

    def truncate_after(self, step: int) -> None:
        self.first_step, self.start = step, self.clock()

    def close(self) -> None:
        pass


class TensorboardLogger:
    """Scalars to event files in ``log_dir`` (``$TENSORBOARD_DIR`` wins, as in verl).

    The ``SummaryWriter`` opens on the first ``log`` so that ``truncate_after(step)`` can give it
    ``purge_step=step + 1``: TensorBoard then hides the abandoned events of later steps from
    the run before the resume instead of drawing two curves over them.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR") or log_dir)
        self._purge_step: int | None = None
        self._writer = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def log(self, metrics: Metrics, step: int) -> None:
        writer = self._open()
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def log_generations(self, samples: Samples, step: int) -> None:
        """One markdown text entry ``val/generations`` per validation."""
        parts = [f"### Sample {i}\n\n**Input:** {inp}\n\n**Output:** {out}\n\n**Score:** {score}\n"
                 for i, (inp, out, score) in enumerate(samples, 1)]
        writer = self._open()
        writer.add_text(GENERATIONS_KEY, f"**Validation generations, step {step}**\n\n" + "\n---\n\n".join(parts), step)
        writer.flush()

    def truncate_after(self, step: int) -> None:
        self.close()
        self._purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _wandb_id(project: str, experiment: str) -> str:
    """The run id ``<project>--<experiment>``, with characters wandb refuses replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{project}--{experiment}")


class WandbLogger:
    """A wandb run named after the experiment (as in verl), with the id ``<project>--<experiment>`` so that a
    resumed training continues the same run (verl starts a new one each time).

    ``WANDB_MODE`` (online/offline/disabled) is honoured; ``WANDB_RUN_ID`` overrides the id. Files go under
    ``run_dir/wandb`` (``$WANDB_DIR`` wins); offline, each start writes a directory there that ``wandb sync``
    uploads into the one run id.
    """

    def __init__(self, run_dir: str | os.PathLike, project: str, experiment: str, config: Any) -> None:
        self.wandb = import_optional("wandb")
        kwargs: dict[str, Any] = {
            "project": project,
            "name": experiment,
            "config": plain(config) if config is not None else None,
            "dir": os.environ.get("WANDB_DIR") or str(run_dir),
            "resume": "allow",
        }
        if not os.environ.get("WANDB_RUN_ID"):
            kwargs["id"] = _wandb_id(project, experiment)
        if os.environ.get("WANDB_MODE"):
            kwargs["mode"] = os.environ["WANDB_MODE"]
        self.run = self.wandb.init(**kwargs)
        self.generation_rows: list[list] = []

    def log(self, metrics: Metrics, step: int) -> None:
        self.run.log(dict(metrics), step=step)   # this run's, not ``wandb.run``: another init must not steal it

    def log_generations(self, samples: Samples, step: int) -> None:
        """verl's ``val/generations`` table, one row per validation: step, then input/output/score of each sample."""
        columns = ["step"] + [f"{part}_{i}" for i in range(1, len(samples) + 1)
                              for part in ("input", "output", "score")]
        row = [step] + [value for sample in samples for value in sample]
        self.generation_rows.append(row)
        width = len(columns)   # rows of earlier validations (fewer samples) are padded to this table's width
        table = self.wandb.Table(columns=columns, data=[r + [None] * (width - len(r)) for r in self.generation_rows])
        self.run.log({GENERATIONS_KEY: table}, step=step)

    def truncate_after(self, step: int) -> None:
        pass  # online, wandb drops (with a warning) steps at or below the resumed run's last one

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


def mlflow_key(key: str) -> str:
    """A metric or param name mlflow accepts, as verl makes it: ``@`` becomes ``_at_``, runs of ``/`` one ``/``
    (mlflow treats names as paths), other characters it refuses ``_``."""
    return _MLFLOW_BAD.sub("_", re.sub("/+", "/", key.replace("@", "_at_"))).strip("/")


def _require_sqlalchemy(uri: str) -> None:
    """An sqlite store needs SQLAlchemy and alembic, which mlflow-skinny lacks (mlflow's own error blames the model
    registry)."""
    try:
        importlib.import_module("sqlalchemy")
        importlib.import_module("alembic")
    except ImportError as err:
        raise ImportError(
            f"trainer.logger names 'mlflow', whose store {uri} needs SQLAlchemy and alembic ({err}): mlflow-skinny "
            "does not bring them. Fix: `pip install mlflow` (or `pip install sqlalchemy alembic`), or set "
            "MLFLOW_TRACKING_URI to a tracking server."
        ) from None


class MlflowLogger:
    """An mlflow run (experiment = project, run name = experiment) with the flattened config as params, as in verl:
    params are the config keys joined by ``/`` (``actor_rollout_ref/actor/ppo_mini_batch_size``); each start, a
    resume too, opens a new run of that name; ``MLFLOW_RUN_ID`` attaches to an existing run instead.

    ``MLFLOW_TRACKING_URI`` is honoured; without it runs go to ``sqlite:///<run_dir>/mlflow.db`` and their artifacts
    to ``<run_dir>/mlartifacts`` (mlflow's own default is ``./mlruns`` of the working directory).
    """

    MAX_PARAM_CHARS = 500  # the smallest param-value limit across mlflow versions

    def __init__(self, run_dir: str | os.PathLike, project: str, experiment: str, config: Any) -> None:
        self.mlflow = import_optional("mlflow")
        run_dir = Path(run_dir).resolve()
        default = not os.environ.get("MLFLOW_TRACKING_URI")
        uri = f"sqlite:///{run_dir / 'mlflow.db'}" if default else os.environ["MLFLOW_TRACKING_URI"]
        if uri.startswith("sqlite:"):
            _require_sqlalchemy(uri)
        self.mlflow.set_tracking_uri(uri)
        if os.environ.get("MLFLOW_RUN_ID"):
            self.run = self.mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
        else:
            if default and self.mlflow.get_experiment_by_name(project) is None:
                self.mlflow.create_experiment(project, artifact_location=(run_dir / "mlartifacts").as_uri())
            exp = self.mlflow.set_experiment(project)
            self.run = self.mlflow.start_run(experiment_id=exp.experiment_id, run_name=experiment)
        try:
            self._log_params({mlflow_key(k): str(v)[: self.MAX_PARAM_CHARS]
                              for k, v in flatten_config(config, sep="/").items()})
        except BaseException:
            self.close()   # an active run left behind would make the next start_run in this process fail
            raise

    def _log_params(self, params: dict[str, str]) -> None:
        """Log ``params``; on an attached run, those it holds already are kept (mlflow refuses to change one)."""
        held = dict(self.run.data.params)
        changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
        if changed:
            warnings.warn(f"mlflow: run {self.run.info.run_id} already holds params {', '.join(changed[:5])}"
                          f"{' ...' if len(changed) > 5 else ''} with other values; they keep their first values",
                          stacklevel=4)
        new = {k: v for k, v in params.items() if k not in held}
        if new:
            self.mlflow.log_params(new)

    def log(self, metrics: Metrics, step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def log_generations(self, samples: Samples, step: int) -> None:
        """The samples as verl's JSON artifact ``val_step<step>.json``: a list of {input, output, score}."""
        rows = [{"input": inp, "output": out, "score": score} for inp, out, score in samples]
        self.mlflow.log_dict(rows, f"val_step{step}.json")

    def truncate_after(self, step: int) -> None:
        pass  # the resumed training logs into a new run

    def close(self) -> None:
        if self.run is not None:
            self.mlflow.end_run()
            self.run = None
