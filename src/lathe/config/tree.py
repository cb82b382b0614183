"""Setting and reading values on the dataclass tree: dotted paths, YAML mappings, verl aliases.

A *layer* (one YAML file, or the list of command-line overrides) is flattened into
``Assignment``s along the schema, verl's old spellings are rewritten to lathe's paths, and each
assignment is checked and applied. All problems of a layer are reported in one ConfigError.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from .coerce import coerce, dump_yaml, hints_of, parse_value, show, type_name
from .errors import ConfigError, ProblemList, closest, did_you_mean
from .schema import GROUP_PRESETS, LatheConfig
from .verl_keys import TARGET, is_verl_group, is_verl_key, verl_defaults, verl_paths
from .verl_translate import translate

# verl's other spellings -> lathe paths (prefix rewrite; the first match wins, so longer keys go first).
ALIASES: dict[str, str] = {
    **{f"{g}.fsdp_config.ulysses_sequence_parallel_size": f"{g}.ulysses_sequence_parallel_size"
       for g in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    **{f"actor_rollout_ref.actor.policy_loss.{k}": f"actor_rollout_ref.actor.{k}" for k in ("tau_pos", "tau_neg")},
    "critic.fsdp.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "critic.fsdp": "critic.model.fsdp_config",             # verl's engine-config spelling of the critic's fsdp group
    # verl's newer spellings of the reward model's switch, checkpoint and pool switch (the pool's sizes stay verl
    # keys: translated, verl's default of 8 devices per node would warn in every whole verl config; lathe's pool is
    # reward_model.nnodes x reward_model.n_gpus_per_node)
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.rollout": "reward_model.rollout",      # the generative judge's engine (schema_judge.py)
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.sandbox_fusion": "reward_model.sandbox_fusion",
    "sandbox_fusion": "reward_model.sandbox_fusion",
    "reward_model.num_workers": "reward.num_workers",
    # the DAPO reward manager's arguments (verl passes them to the manager, not the scoring function)
    "reward_model.reward_kwargs.overlong_buffer_cfg": "reward_model.overlong_buffer",
    "reward.reward_kwargs.overlong_buffer_cfg": "reward_model.overlong_buffer",
    "reward.reward_kwargs.max_resp_len": "reward_model.reward_kwargs.max_resp_len",
    "custom_reward_function.path": "reward.custom_reward_function.path",
    "custom_reward_function.name": "reward.custom_reward_function.name",
    "custom_reward_function.reward_kwargs": "reward.reward_kwargs",
    "reward.custom_reward_function.reward_kwargs": "reward.reward_kwargs",     # verl reads it there too
    "custom_reward_function.overlong_buffer": "reward_model.overlong_buffer",
    # verl's newer spelling of the weight sync's bucket size (one setting, read where the sync is built)
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
}
_ALIAS_GROUPS = {"custom_reward_function", "sandbox_fusion"}


@dataclass
class Assignment:
    """One ``path = value`` from a layer; ``raw`` is the override text, ``spelled`` the key as typed."""

    path: str
    value: Any
    raw: str | None
    spelled: str
    origin: str


# ----------------------------------------------------------------------------- schema walking


def dataclass_type(tp: Any) -> type | None:
    """The dataclass inside an annotation (plain or Optional), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _is_dict_type(tp: Any) -> bool:
    """True for dict / dict[...] / Optional[dict]."""
    if tp is dict or get_origin(tp) is dict:
        return True
    return any(a is dict or get_origin(a) is dict for a in get_args(tp))


@functools.lru_cache(maxsize=None)
def all_paths(root: type = LatheConfig) -> tuple[str, ...]:
    """Every dotted key of the schema `root` (groups and leaves) plus, for `lathe train`'s, the accepted aliases."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in hints_of(cls).items():
            path = f"{prefix}{name}"
            out.append(path)
            sub = dataclass_type(tp)
            if sub is not None:
                walk(sub, path + ".")

    walk(root, "")
    return tuple(out + list(ALIASES) + sorted(_ALIAS_GROUPS)) if root is LatheConfig else tuple(out)


def field_meta(cls: type, name: str) -> dict:
    """The metadata of field ``name`` of dataclass ``cls``."""
    return dict(cls.__dataclass_fields__[name].metadata)


def unknown_key_message(path: str, origin: str, root: type = LatheConfig) -> str:
    """'Unknown key' text: fix the first unknown segment by its siblings, else find the leaf elsewhere."""
    paths = all_paths(root) + (tuple(sorted(verl_paths())) if root is LatheConfig else ())
    known = set(paths)
    parts = path.split(".")
    index = next(i for i in range(len(parts)) if ".".join(parts[: i + 1]) not in known)
    parent, bad, rest = parts[:index], parts[index], parts[index + 1:]
    prefix = ".".join(parent) + "." if parent else ""
    siblings = sorted({p[len(prefix):].split(".")[0] for p in paths if p.startswith(prefix)})
    guesses = []
    for name in closest(bad, siblings, n=2):
        fixed = prefix + name + ("." + ".".join(rest) if rest else "")
        guesses.append(fixed if fixed in known else prefix + name)
    if not guesses:
        guesses = [p for p in paths if p.rsplit(".", 1)[-1] == parts[-1]][:3]
    if not guesses:
        guesses = closest(path, paths, n=2, cutoff=0.75)
    listing = ""
    if len(siblings) <= 15:
        listing = f" Valid keys under `{prefix[:-1] or '(top level)'}`: {', '.join(siblings)}."
    return f"Unknown config key `{path}` ({origin}).{did_you_mean(guesses)}{listing}"


# ----------------------------------------------------------------------------- flattening


def flatten_mapping(mapping: dict, origin: str, root: type = LatheConfig) -> list[Assignment]:
    """Turn a nested YAML mapping into assignments, descending only into schema groups."""
    out: list[Assignment] = []

    def walk(cls: type | None, node: dict, prefix: str) -> None:
        for key, value in node.items():
            key = str(key)
            if key == "_target_":
                continue
            path = f"{prefix}{key}"
            hints = hints_of(cls) if cls is not None else {}
            sub = dataclass_type(hints[key]) if key in hints else None
            group = sub is not None or (cls is LatheConfig and key in _ALIAS_GROUPS)
            if group and isinstance(value, dict):
                walk(sub, value, path + ".")
            else:
                out.append(Assignment(path, value, None, path, origin))

    walk(root, mapping, "")
    return out


_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)\s*=(.*)$", re.S)


_GROUP_CHOICE = re.compile(r"^\+{0,2}([\w\-]+@[\w.\-]+)\s*=\s*(\S+)$")


# Megatron Lite's config package (`verl_mlite`, outside verl) selects a role's config as `<group>@<role>=mlite_<...>`:
# the role then trains with Megatron Lite, whose `engine` group lathe translates (verl_keys.MLITE_ENGINE), so the
# selection stands for `<role>.strategy=megatron_lite` (support_verl's backend notice says lathe's FSDP2 trains it).
_MLITE_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")


def _mlite_role(group: str, choice: str) -> str | None:
    """The role a Megatron Lite config-group selection (`actor@actor_rollout_ref.actor=mlite_actor`) picks, else
    None."""
    role = group.partition("@")[2]
    return role if role in _MLITE_ROLES and choice.startswith("mlite_") else None


def parse_override(text: str) -> Assignment:
    """Parse 'a.b=1', '+a.b=1' or '++a.b=1' (Hydra prefixes tolerated) into an assignment."""
    stripped = text.strip()
    if stripped.startswith("~"):
        raise ConfigError(f"Override '{text}': deleting keys (~key) is not supported. "
                          f"Fix: set the key to null instead, e.g. {stripped[1:].split('=')[0]}=null.")
    match = _OVERRIDE.match(stripped)
    group = _GROUP_CHOICE.match(stripped)
    if not match and group and _mlite_role(group[1], group[2]):
        return Assignment(f"{_mlite_role(group[1], group[2])}.strategy", "megatron_lite", None,
                          f"{_mlite_role(group[1], group[2])}.strategy", f"override '{stripped}'")
    if not match and group:
        raise ConfigError(f"Override '{text}': Hydra config-group selection (`{group[1]}`: this role's keys from "
                          f"the config file `{group[2]}` of a config package) is not implemented yet in lathe. "
                          "Fix: remove it and set the role's keys directly (lathe knows verl's groups).")
    if not match:
        raise ConfigError(f"Override '{text}' is not of the form key=value. "
                          f"Fix: write it like actor_rollout_ref.rollout.n=8 (no spaces around '=').")
    _, key, raw = match.groups()
    return Assignment(key, parse_value(raw), raw, key, f"override '{stripped}'")


def lathe_spelling(path: str) -> str:
    """``path`` with an alias prefix (ALIASES) rewritten to lathe's key."""
    for old, new in ALIASES.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    return path


def rewrite_aliases(items: list[Assignment], problems: ProblemList) -> list[Assignment]:
    """Map old verl spellings onto lathe paths; flag a layer setting both spellings differently."""
    seen: dict[str, Assignment] = {}
    for item in items:
        item.path = lathe_spelling(item.path)
        previous = seen.get(item.path)
        if previous is not None and previous.spelled != item.spelled and previous.value != item.value \
                and not _defers(previous) and not _defers(item):
            old = previous.spelled if previous.spelled != item.path else item.spelled
            problems.add(
                f"`{previous.spelled}`={show(previous.value)} and `{item.spelled}`={show(item.value)} are both "
                f"set, but they are the same setting (`{old}` is verl's other spelling of `{item.path}`). "
                f"Fix: keep only one of them.")
        seen[item.path] = item
    return items


# ----------------------------------------------------------------------------- applying


def _defers(item: Assignment) -> bool:
    """A value that takes the setting from elsewhere: verl's null default, or a ${...} reference."""
    return item.value is None and verl_null(item.spelled) or isinstance(item.value, str) and "${" in item.value


def apply_layer(cfg: LatheConfig, items: list[Assignment], context: str) -> None:
    """Apply a layer's assignments in order; raise one ConfigError listing every problem."""
    problems = ProblemList()
    for item in rewrite_aliases(items, problems):
        try:
            assign(cfg, item)
        except ConfigError as err:
            problems.add(str(err))
    problems.raise_if_any(context)


def assign(root: LatheConfig, item: Assignment) -> None:
    """Set one dotted path (into groups, and into free dict fields) after type checking."""
    parts = item.path.split(".")
    node: Any = root
    if parts[-1] == TARGET:                                  # Hydra's class pointer: nothing to set
        return
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        hints = hints_of(type(node))
        if part not in hints:
            if isinstance(root, LatheConfig) and _assign_verl(root, item):
                return
            raise ConfigError(unknown_key_message(item.path, item.origin, type(root)))
        tp = hints[part]
        if i == len(parts) - 1:
            _set_field(root, node, part, tp, item)
            return
        current = getattr(node, part)
        if dataclasses.is_dataclass(current):
            node = current
            continue
        if _is_dict_type(tp):
            if current is None:
                current = {}
                setattr(node, part, current)
            _set_in_dict(current, parts[i + 1:], item.value)
            return
        raise ConfigError(f"`{path}` is a single value ({type_name(tp)}), not a group, so "
                          f"`{item.path}` cannot be set ({item.origin}). Fix: set `{path}` itself.")


def _assign_verl(root: LatheConfig, item: Assignment) -> bool:
    """A key of verl's schema with no field in lathe's: kept in ``verl_keys`` (a mapping for a verl group is
    taken key by key), plus the lathe keys it translates to. False when verl has no such key either."""
    key = item.spelled if is_verl_key(item.spelled) or is_verl_group(item.spelled) else item.path
    if isinstance(item.value, dict) and item.value and is_verl_group(key):
        for sub, value in item.value.items():
            if str(sub) != TARGET:
                assign(root, Assignment(lathe_spelling(f"{key}.{sub}"), value, None, f"{item.spelled}.{sub}",
                                        item.origin))
        return True
    if not is_verl_key(key):
        return False
    root.verl_keys[key] = item.value
    for path, value in translate(key, item.value):
        assign(root, Assignment(path, value, None, item.spelled, item.origin))
    return True


def _set_field(root: LatheConfig, node: Any, name: str, tp: Any, item: Assignment) -> None:
    """Assign a leaf field, merge a mapping into a group / dict field, or set a group from a preset name."""
    if dataclass_type(tp) in GROUP_PRESETS and isinstance(item.value, str):
        _set_group_preset(root, node, name, dataclass_type(tp), item)
        return
    if dataclass_type(tp) is not None and isinstance(item.value, dict):
        for key, value in item.value.items():
            if str(key) != "_target_":
                child = Assignment(f"{item.path}.{key}", value, None, f"{item.spelled}.{key}", item.origin)
                assign(root, child)
        return
    current = getattr(node, name)
    if _is_dict_type(tp) and isinstance(item.value, dict) and isinstance(current, dict):
        _deep_merge(current, _without_target(item.value))
        return
    meta = field_meta(type(node), name)
    try:
        setattr(node, name, coerce(item.value, tp, item.path, raw=item.raw, example=current, meta=meta))
    except ConfigError:
        if item.value is None and verl_null(item.spelled):
            return                            # verl's "unset" (null by default there): lathe's default stays
        raise


def verl_null(key: str) -> bool:
    """A verl key whose default is null (verl's legacy keys that mean 'take it from elsewhere')."""
    return key in verl_defaults() and verl_defaults()[key] is None


def _set_group_preset(root: LatheConfig, node: Any, name: str, group: type, item: Assignment) -> None:
    """`group=<preset name>` (verl's named factory configs): the group back to its defaults, then the preset's
    values; later assignments to its keys apply on top."""
    presets, aliases = GROUP_PRESETS[group]
    chosen = aliases.get(item.value, item.value)
    if chosen not in presets:
        hint = did_you_mean(closest(item.value, [*presets, *aliases], n=2))
        raise ConfigError(f"`{item.spelled}`={show(item.value)} is not a preset of this group ({item.origin}).{hint} "
                          f"Presets: {', '.join(presets)}. Fix: name one of them, or set the group's keys "
                          f"({item.path}.<key>=...).")
    if chosen != item.value:
        warnings.warn(f"{item.spelled}={item.value} is taken as verl's preset {chosen}: "
                      f"{', '.join(f'{k}={v}' for k, v in presets[chosen].items())}", stacklevel=2)
    setattr(node, name, group())
    for key, value in presets[chosen].items():
        assign(root, Assignment(f"{item.path}.{key}", value, None, f"{item.spelled}.{key}", item.origin))


def _set_in_dict(target: dict, parts: list[str], value: Any) -> None:
    """Set a nested key inside a free-form dict, creating intermediate dicts."""
    for part in parts[:-1]:
        nxt = target.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            target[part] = nxt
        target = nxt
    target[parts[-1]] = value


def _without_target(mapping: dict) -> dict:
    """A mapping without Hydra's ``_target_`` class pointers, at any depth."""
    return {k: _without_target(v) if isinstance(v, dict) else v for k, v in mapping.items() if k != TARGET}


def _deep_merge(target: dict, update: dict) -> None:
    """Merge ``update`` into ``target`` recursively (Hydra-style dict merge)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = value


# ----------------------------------------------------------------------------- reading


def get_path(cfg: LatheConfig, path: str) -> Any:
    """Value at a dotted path (through groups and dicts); KeyError when it does not exist."""
    node: Any = cfg
    for part in path.split("."):
        if dataclasses.is_dataclass(node) and part in hints_of(type(node)):
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(path)
    return node


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts/lists (deep copy), in declaration order."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The config as YAML that load_config reads back to an equal tree."""
    return dump_yaml(to_dict(cfg))
