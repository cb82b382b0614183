"""Metrics and loggers: ``Tracker`` (console, tensorboard, wandb, mlflow, always ``metrics.jsonl``),
``Timer`` (``timing_s/*``, and with ``PeakMemory`` ``perf/max_memory_*_gb``), ``reduce_metrics``, the console
step line, and what a person sees while work runs (``Progress``, ``phase``: a live line on a terminal, timestamped
lines in a log).

Metric names are verl's (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/gen``,
``perf/throughput``, ``val-core/<data_source>/reward/mean@1`` ...); callers produce them, this
package only reduces, formats and writes them.
"""

from lathe.track.console import brief, format_step_line
from lathe.track.jsonl import MetricsFile, read_metrics
from lathe.track.memory import PeakMemory
from lathe.track.metrics import reduce_metrics, to_scalar
from lathe.track.progress import Progress, phase
from lathe.track.timer import Timer
from lathe.track.tracker import METRICS_FILE, VALID_LOGGERS, Tracker

__all__ = [
    "Tracker",
    "Timer",
    "PeakMemory",
    "reduce_metrics",
    "to_scalar",
    "format_step_line",
    "brief",
    "Progress",
    "phase",
    "MetricsFile",
    "read_metrics",
    "METRICS_FILE",
    "VALID_LOGGERS",
]
