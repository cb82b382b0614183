"""verl's config schema as data: every key of verl's generated trainer configs, with verl's default.

lathe declares the keys it acts on in ``schema*.py``. verl's schema also holds whole subtrees lathe will not
build as fields (the megatron / veomni / torchtitan engine groups, per-role profilers, megatron's optimizer and
learning-rate keys, QAT, MTP, ...). Rather than a dataclass field for each of
those ~900 keys, lathe keeps verl's list in ``verl_keys.yaml`` (dotted key -> verl's default) and:

* a key of that list with no field in lathe's tree is stored, as given, in ``LatheConfig.verl_keys``;
* ``verl_translate.py`` turns the ones lathe has an equivalent for into lathe's keys as they are set;
* ``support_verl.py`` judges the rest (refused with the feature's name, no effect, or the same either way).

A key in neither lathe's tree nor this list stays an "Unknown config key" with a did-you-mean over both, so a
typo in a megatron key is still caught. Below a *free map* (a verl key whose value is an open mapping, such as
``megatron.override_transformer_config``) any key is accepted. The file is regenerated from verl's four
``_generated_ppo*_trainer.yaml`` files (interpolations resolved to verl's defaults, ``_target_`` dropped):

    PYTHONPATH=src python -m lathe.config.verl_keys verl/trainer/config/_generated_ppo*.yaml \\
        > src/lathe/config/verl_keys.yaml
"""

from __future__ import annotations

import functools
import re
import sys
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parent / "verl_keys.yaml"
TARGET = "_target_"                       # Hydra's class pointer: accepted anywhere, never stored
GROUPS = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
BACKENDS = ("megatron", "veomni", "torchtitan")

# verl keys whose value is an open mapping: any key below them is one of verl's (patterns, fnmatch over dots)
FREE_MAPS = (
    "*.megatron.override_transformer_config", "*.megatron.override_ddp_config",
    "*.megatron.override_mcore_model_config", "*.turbo_config", "*.checkpoint.mbridge_config",
    "data.mm_processor_kwargs", "*.engine_kwargs",
    "reward.reward_model.rollout.*", "reward_model.rollout.*",
)


# Megatron Lite (verl's `megatron_lite` backend, docs/advance/megatron_lite_backend.rst): its config package
# (`verl_mlite`, outside verl's tree: a script selects it as `actor@actor_rollout_ref.actor=mlite_actor`) gives each
# role an `engine` group. Its leaves as verl's scripts set them, default unknown (None: any value given is taken as
# set); `engine.impl_cfg` is an open map of the engine's implementation switches.
MLITE_ENGINE = ("tp", "pp", "vpp", "ep", "cp", "etp", "param_offload", "optimizer_offload", "grad_offload",
                "attention_backend_override")


@functools.lru_cache(maxsize=1)
def verl_defaults() -> dict[str, Any]:
    """Every leaf key of verl's generated configs -> verl's default (the committed ``verl_keys.yaml``), and
    Megatron Lite's engine group (`MLITE_ENGINE`) for each role."""
    keys = yaml.safe_load(DATA.read_text()) or {}
    keys.update({f"{role}.engine.{leaf}": None for role in GROUPS for leaf in MLITE_ENGINE})
    keys.update({f"{role}.engine.impl_cfg": {} for role in GROUPS})
    return keys


@functools.lru_cache(maxsize=1)
def verl_paths() -> frozenset[str]:
    """verl's leaf keys and every group above them (for lookups and did-you-mean)."""
    out: set[str] = set()
    for key in verl_defaults():
        parts = key.split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return frozenset(out)


def free_map_of(key: str) -> str | None:
    """The free map ``key`` lies below (or is), else None."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        head = ".".join(parts[:i])
        if any(fnmatchcase(head, pattern) for pattern in FREE_MAPS):
            return head
    return None


def is_verl_key(key: str) -> bool:
    """A leaf of verl's schema, or a key below one of its free maps."""
    return key in verl_defaults() or free_map_of(key) is not None or _below_free_leaf(key)


def is_verl_group(key: str) -> bool:
    """A group of verl's schema (a YAML mapping given for it is taken key by key)."""
    return key in verl_paths() and key not in verl_defaults()


def _below_free_leaf(key: str) -> bool:
    """Below a verl leaf whose default is a mapping ({}): an open map too."""
    parts = key.split(".")
    return any(isinstance(verl_defaults().get(".".join(parts[:i])), dict) for i in range(1, len(parts)))


def verl_default(key: str) -> Any:
    """verl's default for ``key`` (None below a free map: nothing is set there by default)."""
    return verl_defaults().get(key)


# ----------------------------------------------------------------------------- regenerating the data file

_REF = re.compile(r"^\$\{(.+)\}$")


def _resolve(tree: dict, node: Any, here: list[str]) -> Any:
    """``node`` with verl's interpolations replaced by the values they point at (oc.select's default else)."""
    if isinstance(node, dict):
        return {k: _resolve(tree, v, here + [str(k)]) for k, v in node.items()}
    if not isinstance(node, str) or not _REF.match(node.strip()):
        return node
    expr = _REF.match(node.strip()).group(1)
    default: Any = None
    if expr.startswith("oc.select:"):
        expr, _, text = expr[len("oc.select:"):].partition(",")
        default = _resolve(tree, text, here) if text.startswith("${") else yaml.safe_load(text) if text else None
    if expr.startswith("."):                                  # relative to the key's own group
        expr = ".".join(here[:-1]) + expr
    target: Any = tree
    for part in expr.split("."):
        if not isinstance(target, dict) or part not in target:
            return default
        target = target[part]
    return _resolve(tree, target, expr.split("."))


def flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> dotted leaf keys (an empty mapping is a leaf; ``_target_`` dropped)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == TARGET:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def generate(files: list[str]) -> str:
    """The text of ``verl_keys.yaml`` from verl's generated config files (first file's default wins)."""
    keys: dict[str, Any] = {}
    for name in files:
        tree = yaml.safe_load(Path(name).read_text())
        for key, value in flatten(_resolve(tree, tree, [])).items():
            keys.setdefault(key, value)
    groups = {key.rsplit(".", i)[0] for key in keys for i in range(1, key.count(".") + 1)}
    keys = {k: v for k, v in keys.items() if k not in groups}     # a null in one file, a group in another
    head = ("# verl's config keys and their defaults (flattened from verl's generated trainer configs); generated "
            "by\n# `python -m lathe.config.verl_keys` (see lathe/config/verl_keys.py). Do not edit by hand.\n")
    return head + yaml.safe_dump(dict(sorted(keys.items())), sort_keys=False, width=200)


if __name__ == "__main__":
    sys.stdout.write(generate(sys.argv[1:]))
