"""What a run directory holds, read for the report: metrics by step, the config, sample dumps.

* ``metrics.jsonl`` (see ``lathe.track.jsonl``): one record per step; when a step appears more than once
  (a resumed run whose file was not truncated, or a writer that logs validation apart), later values win,
  key by key. Values that are not numbers are ignored; NaN and infinities are kept (the plots mark them).
* the config: ``config.yaml`` / ``config.json`` in the run directory, or the one wandb saved there
  (``wandb/latest-run/files/config.yaml``); absent, the header says "unknown".
* samples: ``<dir>/<step>.jsonl`` files as ``lathe.loop.dump`` writes them (``trainer.validation_data_dir``,
  ``trainer.rollout_data_dir``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from lathe.track.jsonl import read_metrics

CONFIG_FILES = ("config.yaml", "config.json", "wandb/latest-run/files/config.yaml")
MAX_TEXT = 4000     # characters of one sample's input or output kept in the report


@dataclass
class Samples:
    """A few rows of each of some ``<step>.jsonl`` files of ``directory`` (or why there are none)."""
    directory: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    files: int = 0          # step files found
    note: str = ""          # why nothing is shown, when nothing is


@dataclass
class Run:
    path: Path
    metrics: dict[int, dict[str, float]]        # step -> {key: value}, steps ascending
    config: dict[str, Any] | None
    config_file: Path | None
    modified: datetime                          # when metrics.jsonl was last written
    validation: Samples | None = None
    rollouts: Samples | None = None

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, m[key]) for step, m in self.metrics.items() if key in m]

    def keys(self) -> list[str]:
        return sorted({k for m in self.metrics.values() for k in m})

    def setting(self, dotted: str) -> Any:
        """``trainer.project_name`` etc. from the config, or None."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def metrics_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/metrics.jsonl`` (or RUN_DIR itself when it names a .jsonl file); a clear error when missing."""
    path = Path(run_dir).expanduser()
    metrics = path if path.suffix == ".jsonl" and path.is_file() else path / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "holds no metrics.jsonl"
        raise FileNotFoundError(f"lathe report: {path} {what}; give a lathe run directory (trainer.default_local_dir, "
                                "which holds the metrics.jsonl a run writes) or a metrics.jsonl file")
    return metrics


def metrics_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """One merged record per step, later values winning; numbers only."""
    steps: dict[int, dict[str, float]] = {}
    for record in records:
        values = {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
        steps.setdefault(record["step"], {}).update(values)
    return dict(sorted(steps.items()))


def load_config(run_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    for name in CONFIG_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                tree = yaml.safe_load(path.read_text(encoding="utf-8"))   # YAML reads JSON too
            except yaml.YAMLError:
                continue
            if isinstance(tree, dict):
                if name.startswith("wandb/"):   # wandb's {key: {desc, value}} layout, plus its own `_wandb`
                    tree = {k: v.get("value") if isinstance(v, dict) else v
                            for k, v in tree.items() if not str(k).startswith("_")}
                return tree, path
    return None, None


def spread(items: list, k: int) -> list:
    """``k`` items evenly spaced over ``items``, first and last included."""
    if len(items) <= k:
        return list(items)
    if k <= 1:
        return list(items[-1:]) if k == 1 else []
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_TEXT else f"{text[:MAX_TEXT]}… ({len(text) - MAX_TEXT} more characters)"


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_samples(directory: str | Path, per_step: int, max_steps: int = 12) -> Samples:
    """``per_step`` rows spread over each of ``max_steps`` step files spread over the run."""
    directory = Path(directory).expanduser()
    samples = Samples(directory)
    files = sorted((p for p in directory.glob("*.jsonl") if p.stem.isdigit()), key=lambda p: int(p.stem))
    samples.files = len(files)
    if not files:
        samples.note = f"{directory}: no <step>.jsonl files" if directory.is_dir() else f"{directory} does not exist"
        return samples
    for path in reversed(spread(files, max_steps)):       # latest step first
        for row in spread(_read_rows(path), per_step):
            score = row.get("score", row.get("reward"))
            samples.rows.append({"step": int(path.stem), "input": _clip(row.get("input", "")),
                                 "output": _clip(row.get("output", "")), "gts": _clip(row.get("gts", "")),
                                 "score": score if isinstance(score, int | float) else None})
    return samples


def load_run(run_dir: str | Path, *, val_dir: str | Path | None = None, rollout_dir: str | Path | None = None,
             max_samples: int = 4) -> Run:
    """Everything the report shows; ``val_dir``/``rollout_dir`` default to the config's dump directories."""
    path = metrics_path(run_dir)
    metrics = metrics_by_step(read_metrics(path))
    if not metrics:
        raise ValueError(f"lathe report: {path} holds no step records (lines like {{\"step\": 1, ...}}); "
                         "did the run log its first step?")
    config, config_file = load_config(path.parent)
    run = Run(path.parent, metrics, config, config_file, datetime.fromtimestamp(path.stat().st_mtime))
    val_dir = val_dir or run.setting("trainer.validation_data_dir")
    rollout_dir = rollout_dir or run.setting("trainer.rollout_data_dir")
    if val_dir and max_samples > 0:
        run.validation = read_samples(val_dir, max_samples)
    if rollout_dir and max_samples > 0:
        run.rollouts = read_samples(rollout_dir, max_samples)
    return run
