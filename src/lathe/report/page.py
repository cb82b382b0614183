"""The report page: header, config, one chart per panel, sample tables, every metric's summary.

Every piece of text from the run (metric names, config values, model inputs and outputs) goes through
``html.escape``: nothing a model writes can become markup.
"""

from __future__ import annotations

from datetime import datetime
from html import escape
from math import isfinite

import yaml

from lathe.report.run import Run, Samples
from lathe.report.svg import PALETTE, fmt, line_chart

# (title, y-axis label, metric names, or a prefix ending in "/" for every metric under it)
PANELS: tuple[tuple[str, str, tuple[str, ...] | str], ...] = (
    ("Score and reward", "mean per sample", ("critic/score/mean", "critic/rewards/mean")),
    ("Loss", "nats per trained token", ("train/loss", "val/loss")),                 # lathe sft
    ("Validation", "", "val-core/"),
    ("KL", "", ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty")),
    ("Entropy", "nats per token", ("actor/entropy",)),
    ("Response length", "tokens", ("response_length/mean", "response_length/max")),
    ("Responses clipped at max length", "fraction", ("response_length/clip_ratio",)),
    ("Policy loss", "", ("actor/pg_loss",)),
    ("Gradient norm", "", ("actor/grad_norm", "critic/grad_norm", "train/grad_norm")),
    ("Learning rate", "", ("actor/lr", "train/lr")),
    ("Value loss", "", ("critic/vf_loss",)),
    ("Time per phase", "seconds", "timing_s/"),
    ("Throughput", "tokens / s", ("perf/throughput",)),
    ("Time per step", "seconds", ("perf/time_per_step",)),
    ("Memory", "GB", ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb")),
    ("GPU power per phase", "watts (all the run's GPUs)", "perf/power_w/"),     # lathe.track.energy
    ("Validation, more", "", "val-aux/"),
)
PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
          "step")   # timing_s/* in pipeline order; others follow alphabetically
SCORE = "critic/score/mean"

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{margin:0 0 8px;font-size:22px} h2{margin:28px 0 10px;font-size:18px;border-bottom:1px solid #ddd}
.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0}
.meta dt{color:#666} .meta dd{margin:0;word-break:break-all}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:16px}
.panel{border:1px solid #e3e3e3;border-radius:6px;padding:8px 10px} .panel svg{width:100%;height:auto}
.panel h3{margin:0 0 4px;font-size:15px}
svg text{font:11px system-ui,sans-serif;fill:#444} svg .label{fill:#666}
svg .area{fill:#fcfcfc;stroke:#bbb} svg .grid{stroke:#e8e8e8}
svg .line{fill:none;stroke-width:1.8} svg circle:hover{r:5} svg .bad{fill:#d62728}
.legend{list-style:none;padding:0;margin:4px 0 0;font-size:12px;display:flex;flex-wrap:wrap;gap:2px 14px}
.legend i{display:inline-block;width:14px;border-top:3px solid;margin:0 5px 3px 0;vertical-align:middle}
.note{color:#8a6d00;font-size:12px} .muted{color:#777}
table{border-collapse:collapse;width:100%;font-size:12px} th,td{border:1px solid #e3e3e3;padding:4px 6px;
vertical-align:top;text-align:left} th{background:#f5f5f5}
td pre{margin:0;max-height:14em;overflow:auto;white-space:pre-wrap;word-break:break-word}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap;width:1%}
.samples th:nth-child(3),.samples th:nth-child(4){width:42%}
details pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:40em}
"""


def panel_keys(spec: tuple[str, ...] | str, keys: list[str]) -> list[str]:
    if isinstance(spec, tuple):
        return [k for k in spec if k in keys]
    found = [k for k in keys if k.startswith(spec)]
    if spec in ("timing_s/", "perf/power_w/"):
        order = {f"{spec}{p}": i for i, p in enumerate(PHASES)}
        found.sort(key=lambda k: (order.get(k, len(order)), k))
    return found


def _last_finite(points: list[tuple[int, float]]) -> tuple[int, float] | None:
    return next(((s, v) for s, v in reversed(points) if isfinite(v)), None)


def _best(points: list[tuple[int, float]]) -> tuple[int, float] | None:
    good = [(s, v) for s, v in points if isfinite(v)]
    return max(good, key=lambda p: p[1]) if good else None      # the earliest step of the highest value


def _panel(run: Run, title: str, y_label: str, names: list[str]) -> str:
    shown = names[:len(PALETTE)]
    chart = line_chart({k: run.series(k) for k in shown}, title=title, y_label=y_label)
    legend = []
    for i, key in enumerate(shown):
        last = _last_finite(run.series(key))
        value = f" <b>{fmt(last[1])}</b>" if last else ""
        style = f"border-color:{PALETTE[i]}" + (";border-top-style:dashed" if i % 2 else "")   # as the line
        legend.append(f'<li><i style="{style}"></i>{escape(key)}{value}</li>')
    bad = sum(not isfinite(v) for k in shown for _, v in run.series(k))
    notes = [f"{bad} NaN/infinite value(s), marked in red on the x axis"] if bad else []
    if len(names) > len(shown):
        notes.append(f"{len(names) - len(shown)} more series in the metrics table below")
    note = "".join(f'<div class="note">{escape(n)}</div>' for n in notes)
    return (f'<div class="panel"><h3>{escape(title)}</h3>{chart}<ul class="legend">{"".join(legend)}</ul>'
            f"{note}</div>")


def _meta(run: Run) -> str:
    keys = run.keys()
    steps = list(run.metrics)
    rows = [("project", run.setting("trainer.project_name")), ("experiment", run.setting("trainer.experiment_name")),
            ("run directory", run.path), ("model", run.setting("actor_rollout_ref.model.path") or run.setting("model.path")),
            ("algorithm", run.setting("algorithm.adv_estimator")),
            ("steps", f"{len(steps)} logged, {steps[0]} to {steps[-1]}"),
            ("metrics last written", run.modified.strftime("%Y-%m-%d %H:%M:%S"))]
    step_time = [v for _, v in run.series("timing_s/step") if isfinite(v)]
    if step_time:
        rows.append(("time in steps", f"{sum(step_time):.1f} s over {len(step_time)} steps"))
    for key in [SCORE] * (SCORE in keys) + [k for k in keys if k.startswith("val-core/")]:
        points = run.series(key)
        last, best = _last_finite(points), _best(points)
        if last and best:
            rows.append((key, f"final {fmt(last[1])} (step {last[0]}), best {fmt(best[1])} (step {best[0]})"))
    body = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in rows if v is not None)
    return f'<dl class="meta">{body}</dl>'


def _config(run: Run) -> str:
    if run.config is None:
        return (f'<p class="muted">No saved config in {escape(str(run.path))} (looked for config.yaml, config.json, '
                "wandb/latest-run/files/config.yaml): project, experiment, model and algorithm unknown.</p>")
    text = yaml.safe_dump(run.config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return (f"<details><summary>Config ({escape(str(run.config_file))})</summary>"
            f"<pre>{escape(text)}</pre></details>")


def _samples(title: str, samples: Samples | None) -> str:
    if samples is None:
        return ""
    head = f"<h2>{escape(title)}</h2>"
    if not samples.rows:
        return head + f'<p class="muted">{escape(samples.note or "no samples")}</p>'
    steps = len({r["step"] for r in samples.rows})
    rows = "".join(
        f'<tr><td class="num">{r["step"]}</td><td class="num">{"" if r["score"] is None else fmt(r["score"])}</td>'
        f'<td><pre>{escape(r["input"])}</pre></td><td><pre>{escape(r["output"])}</pre></td>'
        f'<td><pre>{escape(r["gts"])}</pre></td></tr>' for r in samples.rows)
    return (head + f'<p class="muted">{escape(str(samples.directory))}: a few samples of {steps} of its '
            f'{samples.files} step files, latest first.</p><table class="samples"><tr><th>step</th><th>score</th>'
            f"<th>input</th><th>output</th><th>ground truth</th></tr>{rows}</table>")


def _metric_table(run: Run) -> str:
    rows = []
    for key in run.keys():
        points = run.series(key)
        good = [v for _, v in points if isfinite(v)]
        last = _last_finite(points)
        cells = [fmt(last[1]) if last else "", fmt(min(good)) if good else "", fmt(max(good)) if good else "",
                 str(len(points)), str(len(points) - len(good))]
        rows.append(f"<tr><td>{escape(key)}</td>" + "".join(f'<td class="num">{c}</td>' for c in cells) + "</tr>")
    return ("<details><summary>Every metric: final, min, max</summary><table><tr><th>metric</th><th>final</th>"
            "<th>min</th><th>max</th><th>steps</th><th>NaN/inf</th></tr>" + "".join(rows) + "</table></details>")


def render(run: Run) -> str:
    """The whole report as one HTML document (no scripts, no external resources)."""
    keys = run.keys()
    name = run.setting("trainer.experiment_name") or run.path.name
    panels = [_panel(run, title, label, names) for title, label, spec in PANELS
              if (names := panel_keys(spec, keys))]
    return "\n".join([
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f"<title>lathe report: {escape(str(name))}</title><style>{CSS}</style></head><body>",
        f"<h1>lathe run: {escape(str(name))}</h1>", _meta(run), _config(run),
        "<h2>Metrics</h2>", f'<div class="panels">{"".join(panels)}</div>' if panels else
        '<p class="muted">None of the plotted metrics is in this run; see the table below.</p>',
        _samples("Validation samples", run.validation), _samples("Rollout samples", run.rollouts),
        "<h2>All metrics</h2>", _metric_table(run),
        f'<p class="muted">Written by lathe report at {datetime.now():%Y-%m-%d %H:%M:%S}.</p>',
        "</body></html>\n"])
