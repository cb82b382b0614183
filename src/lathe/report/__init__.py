"""``lathe report RUN_DIR``: a run directory as one self-contained HTML file.

    from lathe.report import write_report
    write_report("checkpoints/lathe/default")            # -> checkpoints/lathe/default/report.html

Charts (score, validation, KL, entropy, response length, losses, timing, throughput, memory) are inline SVG
drawn here; the page has no scripts and loads nothing, so it opens offline and can be mailed or archived.
Validation and rollout samples come from ``trainer.validation_data_dir`` / ``trainer.rollout_data_dir``
when the saved config names them, or from the directories given.
"""

from __future__ import annotations

from pathlib import Path

from lathe.report.page import render
from lathe.report.run import Run, load_run

__all__ = ["write_report", "load_run", "render", "Run"]


def write_report(run_dir: str | Path, out: str | Path | None = None, *, val_dir: str | Path | None = None,
                 rollout_dir: str | Path | None = None, max_samples: int = 4) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``run_dir/report.html``); returns its path.

    ``max_samples``: samples shown per step file of the validation and rollout dumps (0: none)."""
    run = load_run(run_dir, val_dir=val_dir, rollout_dir=rollout_dir, max_samples=max_samples)
    path = Path(out).expanduser() if out else run.path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(run), encoding="utf-8")
    return path
