"""``Tracker``: fans one dict of metrics per step out to the loggers named in ``trainer.logger``.

    tracker = Tracker(["console", "tensorboard"], run_dir, project="gsm8k", experiment="grpo-0.5b",
                      config=cfg_dict, total_steps=60)
    tracker.truncate_after(resumed_step)      # on resume, before logging anything
    tracker.log({"critic/score/mean": 0.62, "timing_s/step": 1.2}, step=12)
    tracker.close()

``run_dir/metrics.jsonl`` is always written, whatever the logger list (the ``jsonl``/``file``
names are accepted and mean just that). Metric values may be tensors, numpy numbers or lists;
they are turned into plain numbers once, here. A value that holds no number is dropped with a
warning naming the key, and a remote logger (wandb, mlflow) that fails mid-run is warned about
and skipped for that step: losing a chart point must never end a training run.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from lathe.track.backends import ConsoleLogger, MlflowLogger, TensorboardLogger, WandbLogger
from lathe.track.jsonl import MetricsFile
from lathe.track.metrics import to_scalar

__all__ = ["Tracker", "VALID_LOGGERS", "METRICS_FILE"]

VALID_LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb", "mlflow")
METRICS_FILE = "metrics.jsonl"


def check_logger_names(loggers: str | Iterable[str]) -> list[str]:
    """``trainer.logger`` as a de-duplicated list; an unknown name raises with the valid ones."""
    names = [loggers] if isinstance(loggers, str) else list(loggers)
    out: list[str] = []
    for name in names:
        if name not in VALID_LOGGERS:
            close = difflib.get_close_matches(str(name), VALID_LOGGERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"trainer.logger: unknown logger {name!r}{hint}. Valid loggers: {', '.join(VALID_LOGGERS)}. "
                f"Fix: e.g. trainer.logger='[console,tensorboard]'."
            )
        if name not in out:
            out.append(name)
    return out


class Tracker:
    """Writes every step's metrics to ``metrics.jsonl`` and to each named logger backend."""

    def __init__(
        self,
        loggers: str | Iterable[str],
        run_dir: str | os.PathLike,
        *,
        project: str,
        experiment: str,
        config: Mapping[str, Any] | None,
        total_steps: int | None = None,
        printer: Callable[[str], None] | None = None,
    ) -> None:
        """``printer`` receives the console line (default: stdout, stamped ``HH:MM:SS``); pass e.g.
        ``logging.getLogger("lathe").info`` to route it through logging. ``total_steps`` is shown
        as ``step s/total``."""
        self.names = check_logger_names(loggers)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.project, self.experiment, self.config = project, experiment, config
        self.metrics_file = MetricsFile(self.run_dir / METRICS_FILE)
        self.backends: dict[str, Any] = {}
        self._warned: set[str] = set()
        try:
            self._open_backends(total_steps, printer)
        except BaseException:
            self.close()
            raise

    def _open_backends(self, total_steps: int | None, printer: Callable[[str], None] | None) -> None:
        for name in self.names:
            if name == "console":
                self.backends[name] = ConsoleLogger(total_steps, printer)
            elif name == "tensorboard":
                self.backends[name] = TensorboardLogger(self.run_dir / "tensorboard")
            elif name == "wandb":
                self.backends[name] = WandbLogger(self.run_dir, self.project, self.experiment, self.config)
            elif name == "mlflow":
                self.backends[name] = MlflowLogger(self.run_dir, self.project, self.experiment, self.config)

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, stacklevel=3)

    def _scalars(self, metrics: Mapping[str, Any]) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for key, value in metrics.items():
            try:
                out[str(key)] = to_scalar(str(key), value)
            except TypeError as err:
                self._warn_once(f"key:{key}", f"Tracker: dropping metric {key!r}: {err}")
        return out

    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float | int]:
        """Log ``metrics`` for ``step`` everywhere; returns the plain numbers that were logged."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Tracker.log: step must be a non-negative int, got {step!r}")
        scalars = self._scalars(metrics)
        self.metrics_file.append(step, scalars)
        for name, backend in self.backends.items():
            try:
                backend.log(scalars, step)
            except Exception as err:  # noqa: BLE001 - a chart backend must not end the run
                if name in ("console", "tensorboard"):
                    raise
                self._warn_once(f"backend:{name}", f"Tracker: logger {name!r} failed at step {step}: {err!r}")
        return scalars

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """Send (input, output, score) samples to every logger that shows text (verl's log_val_generations)."""
        for name, backend in self.backends.items():
            try:
                backend.log_generations(samples, step)
            except Exception as err:  # noqa: BLE001 - a sample table must not end the run either
                if name in ("console", "tensorboard"):
                    raise
                self._warn_once(f"generations:{name}", f"Tracker: logger {name!r} failed to log generations at "
                                                       f"step {step}: {err!r}")

    def truncate_after(self, step: int) -> int:
        """Resume at ``step``: forget logged steps ``> step`` (jsonl lines; tensorboard purge).

        Returns how many jsonl lines were dropped. Call before the first ``log`` of the resumed run.
        """
        for backend in self.backends.values():
            backend.truncate_after(step)
        return self.metrics_file.truncate_after(step)

    def close(self) -> None:
        """Flush and close every logger; safe to call twice."""
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception as err:  # noqa: BLE001
                warnings.warn(f"Tracker: closing a logger failed: {err!r}", stacklevel=2)
        self.backends = {}
        self.metrics_file.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
