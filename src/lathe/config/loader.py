"""``load_config``: defaults -> preset / YAML file -> overrides -> interpolation -> fill-ins -> rules.

Everything here is pure Python + PyYAML so that a bad config fails in milliseconds, before torch,
transformers or any model is imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .backends import apply_engine_kwargs
from .coerce import load_yaml
from .errors import ConfigError, ProblemList, closest, did_you_mean
from .fill import fill_defaults
from .interpolate import resolve_interpolations
from .plan import resolve_devices
from .rules import check_config, check_visible_devices
from .rules_agent import apply_tool_agent
from .schema import LatheConfig
from .support import check_support
from .tree import apply_layer, flatten_mapping, parse_override
from .verl_translate import block_recompute, drop_tp_beside_ep, engine_data_parallel, pack_for_context_parallel

PRESET_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "default"


def list_presets() -> list[str]:
    """Names of the bundled presets (``presets/*.yaml`` without the suffix), sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def describe_preset(name: str) -> str:
    """A preset's one-line summary: the first comment line of its file."""
    first = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()[0]
    return first.lstrip("#").strip() if first.startswith("#") else ""


def load_config(source: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                device_count: int | None = None) -> LatheConfig:
    """Build, resolve and validate a config.

    ``source``: None -> preset "default"; a preset name; or a YAML file (a partial tree applied over
    the dataclass defaults, or over the preset named by its top-level ``preset:`` key).
    ``overrides``: ``key=value`` strings (Hydra's ``+``/``++`` prefixes tolerated), values as YAML.
    ``device_count``: devices the batch is split over; None -> trainer.nnodes x trainer.n_gpus_per_node. Given,
    it plans the batch arithmetic for that many devices and the devices this machine has are not checked.
    Raises ConfigError listing every problem (keys lathe does not implement yet included, see
    ``support.py``); warnings for allowed-but-suspicious combinations and for keys that have no effect.
    """
    cfg = LatheConfig()
    _apply_source(cfg, DEFAULT_PRESET if source is None else source, chain=[])
    _apply_overrides(cfg, overrides)
    resolve_interpolations(cfg)
    drop_tp_beside_ep(cfg)                  # verl's Megatron/torchtitan TP beside EP: FSDP over those devices
    block_recompute(cfg)                    # Megatron's block recompute: the first N layers recompute
    devices = resolve_devices(cfg, device_count)
    problems = ProblemList()
    apply_engine_kwargs(cfg, problems)      # verl's engine arguments with a lathe meaning set the rollout keys
    apply_tool_agent(cfg)                   # verl's default_agent_loop=tool_agent: lathe's tool loop
    check_support(cfg, problems)
    pack_for_context_parallel(cfg)          # verl's context parallelism over padded micro-batches: Ulysses, packed
    engine_data_parallel(cfg)               # verl's data-parallel attention: replicas of TP ranks
    if device_count is None:
        check_visible_devices(cfg, problems)
    filled = ProblemList()
    fill_defaults(cfg, devices.count, filled)
    for message in filled.problems:
        problems.add(message)
    if not filled.problems:
        check_config(cfg, devices, problems)
    problems.raise_if_any()
    return cfg


def _resolve_source(source: str | os.PathLike, base: Path | None) -> Path:
    """A preset name or a YAML path -> the file to read (ConfigError with suggestions if neither)."""
    text = str(source)
    presets = list_presets()
    if text in presets:
        return PRESET_DIR / f"{text}.yaml"
    path = Path(os.path.expanduser(text))
    if not path.is_absolute() and base is not None and not path.exists():
        path = base / path
    if path.is_file():
        return path
    hint = did_you_mean(closest(text, presets, n=2))
    raise ConfigError(f"Config source '{text}' is neither a preset nor an existing YAML file.{hint} "
                      f"Presets: {', '.join(presets)}. Fix: pass a preset name or the path to a .yaml file.")


def _read_mapping(path: Path) -> dict:
    """Parse one YAML file that must contain a mapping (an empty file is an empty mapping)."""
    try:
        data = load_yaml(path.read_text())
    except Exception as err:  # yaml errors carry line/column; keep them in the message
        raise ConfigError(f"Cannot parse YAML file {path}: {err}. Fix: correct the YAML syntax.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"YAML file {path} must contain a mapping of config keys at the top level, "
                          f"got {type(data).__name__}. Fix: write it like `data:\\n  train_batch_size: 64`.")
    return data


def _apply_source(cfg: LatheConfig, source: str | os.PathLike, chain: list[Path],
                  base: Path | None = None) -> None:
    """Apply a preset/YAML file, after the preset it names with a top-level ``preset:`` key."""
    path = _resolve_source(source, base)
    if path in chain:
        loop = " -> ".join(str(p) for p in chain + [path])
        raise ConfigError(f"Preset chain loops: {loop}. Fix: remove one of the `preset:` keys.")
    data = _read_mapping(path)
    parent = data.pop("preset", None)
    if parent is not None:
        _apply_source(cfg, str(parent), chain + [path], base=path.parent)
    label = f"in {path.name}" if path.parent == PRESET_DIR else f"in file {path}"
    apply_layer(cfg, flatten_mapping(data, label), context=f"Config file {path}: ")


def _apply_overrides(cfg: LatheConfig, overrides: Sequence[str]) -> None:
    """Apply command-line overrides in order (later wins); all problems reported together."""
    if isinstance(overrides, str):
        overrides = [overrides]
    problems = ProblemList()
    items = []
    for text in overrides:
        try:
            items.append(parse_override(text))
        except ConfigError as err:
            problems.add(str(err))
    problems.raise_if_any()
    apply_layer(cfg, items, context="")
