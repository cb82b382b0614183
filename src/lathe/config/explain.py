"""What lathe does with each ``key=value`` of a verl command line: acts, acts under another name, has no effect,
or is refused — one row per override, from the same tree, aliases and support registry ``load_config`` uses.

``explain`` never raises on a bad key: an unknown key, a value of the wrong type or a refused feature is a row
of its own, and the cross-field rules' problems (which belong to no single key) come back separately.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import ConfigError, ProblemList
from .loader import load_config, _apply_source
from .plan import trainer_devices
from .schema import LatheConfig
from .backends import BACKENDS, R
from .coerce import show
from .support import _defaults, registry
from .support_verl import entry_for, verdict_for
from .verl_translate import RECOMPUTE, block_recompute_counts, translate
from .tree import assign, get_path, parse_override, rewrite_aliases

ACTS, RENAMED, NO_EFFECT, SAME, REFUSED, UNKNOWN = "acts", "acts as", "no effect", "same either way", "refused", \
    "unknown"


@dataclass
class Row:
    """One override: the key as written, its value text, the verdict and the reason (or lathe's own key)."""

    key: str
    value: str
    verdict: str          # one of ACTS, RENAMED, NO_EFFECT, SAME, REFUSED, UNKNOWN
    why: str = ""
    feature: str = ""     # refused: the feature lathe lacks, as the support registry names it
    command: str | None = None   # what `lathe migrate` prints for it in lathe's command: None = as written, "" = none


@dataclass
class Explanation:
    rows: list[Row]
    problems: list[str] = field(default_factory=list)   # cross-field rules and other whole-config problems

    @property
    def refused(self) -> list[Row]:
        return [r for r in self.rows if r.verdict in (REFUSED, UNKNOWN)]


def explain(overrides: Sequence[str], source: str = "base") -> Explanation:
    """Classify each override against ``source`` (a preset or YAML file), then try the whole config (for the
    devices it names: the machine this runs on is not checked)."""
    rows: list[Row] = []
    cfg = LatheConfig()
    _apply_source(cfg, source, chain=[])
    applied: list[tuple[Row, str]] = []                    # (row, lathe path) of overrides that took
    for text in overrides:
        key, _, raw = text.partition("=")
        try:
            item = parse_override(text)
        except ConfigError as err:
            rows.append(Row(key.strip(), raw, UNKNOWN, str(err)))
            continue
        spelled = item.path
        row = Row(key.lstrip("+"), raw, ACTS)
        rewrite_aliases([item], ProblemList())
        if item.path != spelled:
            row.verdict, row.why = RENAMED, f"`{item.path}`"
        elif item.path == f"{R}.name" and item.value in BACKENDS:
            row.verdict, row.why = RENAMED, (f"lathe's engine in {item.value}'s place (its engine keys and "
                                             f"engine_kwargs.{item.value}.* act where lathe's engine has them)")
        try:
            assign(cfg, item)
        except ConfigError as err:
            row.verdict, row.why = UNKNOWN, str(err)
        else:
            applied.append((row, item.path))
        rows.append(row)
    _judge(cfg, applied)
    problems: list[str] = []
    if not any(r.verdict in (REFUSED, UNKNOWN) for r in rows):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_config(source, list(overrides), device_count=trainer_devices(cfg))   # not this machine's
        except ConfigError as err:
            problems = [line.strip() for line in str(err).splitlines() if line.strip()]
            if len(problems) > 1 and problems[0].endswith("problems:"):
                problems = problems[1:]
    return Explanation(rows, problems)


def _judge(cfg: LatheConfig, applied: list[tuple[Row, str]]) -> None:
    """The registry's verdict on every key, given to the overrides that set it (or a group holding it)."""
    for key, entry in registry().items():
        verdict = entry.verdict(get_path(cfg, key), get_path(_defaults(), key), cfg)
        for row, path in applied:
            if not (path == key or path.startswith(key + ".") or key.startswith(path + ".")):
                continue
            if verdict is None:
                if entry.kind == "inert" and row.verdict == ACTS:
                    row.verdict, row.why = SAME, entry.text
                continue
            _set(row, verdict, entry.text)
    for row, path in applied:                          # verl keys lathe has no field for (support_verl.py)
        if row.key not in cfg.verl_keys:
            continue
        value = cfg.verl_keys[row.key]
        if translate(row.key, value):
            row.verdict, row.why = RENAMED, ", ".join(f"`{k}`={show(v)}" for k, v in translate(row.key, value))
        elif (verdict := verdict_for(row.key, value, cfg)) is not None:
            _set(row, verdict, getattr(entry_for(row.key), "text", ""))
        elif (entry := entry_for(row.key)) is not None:
            row.verdict, row.why = SAME, entry.text
    _block_recompute(cfg, applied)


def _block_recompute(cfg: LatheConfig, applied: list[tuple[Row, str]]) -> None:
    """Megatron's block recompute acts through the count its keys give together, times the pipeline stages (whose
    keys have no effect of their own: `verl_translate.block_recompute`): recompute_num_layers' row carries lathe's
    count (the command sets it), recompute_method's row points to it."""
    for role, (group, n) in block_recompute_counts(cfg).items():
        key = f"`{group}.gradient_checkpointing_layers`={n}"
        for row, _ in applied:
            if row.key == f"{role}.{RECOMPUTE}num_layers":
                row.verdict, row.why, row.command = RENAMED, key, f"{group}.gradient_checkpointing_layers={n}"
            elif row.key == f"{role}.{RECOMPUTE}method":
                row.verdict, row.why, row.command = RENAMED, f"{key} (with recompute_num_layers)", ""


def _set(row: Row, verdict: tuple[str, str], feature: str) -> None:
    """A refusal (naming its feature) wins over a no-effect note."""
    kind, message = verdict
    if kind == "refuse":
        row.verdict, row.why, row.feature = REFUSED, message, feature
    elif row.verdict != REFUSED:
        row.verdict, row.why = NO_EFFECT, message
