"""Load the trainer arguments of verl's example launch scripts (``verl_scripts/*.txt``) and name what stops each.

``problems(name)`` loads one script for its own device count and returns its problems as short labels: the
feature a refusal names ("tensor parallelism (lathe issue 43: ...)"), ``unknown key <key>``, or the start of
any other message. An override layer with unknown keys fails before the values are judged, so those
arguments are dropped and the script is loaded again until the rest has been judged too.

Run as a script for the README's table: ``PYTHONPATH=src python tests/config/verl_corpus.py``.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

from lathe.config import ConfigError, load_config
from lathe.config.backends import KV_CACHE, QUANTIZED, SPECULATIVE
from lathe.config.support import registry
from lathe.config.support_verl import patterns

SCRIPTS = Path(__file__).resolve().parent / "verl_scripts"
_NUMBERED = re.compile(r"^\s+\d+\. ")
_KEY = re.compile(r"^`(?P<key>[^`]+)`[=:]")
_UNKNOWN = re.compile(r"Unknown config key `(?P<key>[^`]+)` \(override '(?P<arg>[^']+)'\)")
_NOT_OVERRIDE = re.compile(r"^Override '(?P<arg>[^']+)'")
_GROUP_CHOICE = "Hydra config-group selection"
_BAD_VALUE = re.compile(r"^(?P<key>[\w.]+?)(\[\d+\])?=\S* is not one of the values this key takes")


@functools.lru_cache(maxsize=1)
def refused_features() -> tuple[str, ...]:
    """The feature names refusals use (the registry's and support_verl's), longest first."""
    texts = {e.text for e in registry().values() if e.kind == "refuse"}
    texts |= {e.text for e in patterns() if e.kind == "refuse"} | {KV_CACHE, QUANTIZED, SPECULATIVE}
    return tuple(sorted(texts, key=len, reverse=True))


def names() -> list[str]:
    return sorted(p.stem for p in SCRIPTS.glob("*.txt"))


def arguments(name: str) -> list[str]:
    """The script's ``key=value`` arguments (``--config-path``/``--config-name`` lines left out)."""
    lines = (SCRIPTS / f"{name}.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("--")]


def device_count(items: list[str]) -> int:
    sizes = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 1}
    for item in items:
        key, _, value = item.lstrip("+").partition("=")
        if key in sizes and value.strip().isdigit():
            sizes[key] = int(value)
    return sizes["trainer.nnodes"] * sizes["trainer.n_gpus_per_node"]


def messages(error: ConfigError) -> list[str]:
    """The problems one ConfigError lists (numbered list or a single message)."""
    lines = str(error).splitlines()
    if len(lines) > 1 and lines[0].rstrip().endswith("config problems:"):
        return [_NUMBERED.sub("", line) for line in lines[1:]]
    return [str(error).split(": ", 1)[1] if str(error).startswith("Config file ") else str(error)]


def label(message: str) -> tuple[str, str]:
    """(label, the key it is about or '')."""
    key = m["key"] if (m := _KEY.match(message)) else ""
    for feature in refused_features():
        if f"{feature} is not implemented yet in lathe" in message or f"({feature}) is not implemented yet" in message:
            return feature, key
    if _GROUP_CHOICE in message:
        return _GROUP_CHOICE, _NOT_OVERRIDE.match(message)["arg"]
    if m := _UNKNOWN.search(message):
        return f"unknown key {m['key']}", m["key"]
    if m := _NOT_OVERRIDE.match(message):
        return f"not an override: {m['arg']}", m["arg"]
    key = message.split("=", 1)[0].strip("` ") if "=" in message.split(" ", 1)[0] else ""
    return re.sub(r"\s+", " ", message)[:200], key


@functools.lru_cache(maxsize=None)
def problems(name: str) -> list[tuple[str, str]]:
    """Every (label, key) that stops the script from loading; [] when it loads."""
    items = arguments(name)
    found: list[tuple[str, str]] = []
    for _ in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_config("base", items, device_count=device_count(items))
            return found
        except ConfigError as err:
            found_now = [label(m) for m in messages(err)]
            dropped = {m["arg"].strip() for text in messages(err) for m in [_UNKNOWN.search(text) or
                                                                           _NOT_OVERRIDE.match(text)] if m}
            bad_values = {m["key"] for text in messages(err) if (m := _BAD_VALUE.match(text))}
            dropped |= {i for i in items if i.lstrip("+").split("=", 1)[0] in bad_values}
            found += found_now
            if not dropped:
                return found
            items = [i for i in items if i not in dropped]
    return found


SHORT = [(r"ghost rows would pad the ranks' shares", "a mini-batch that does not divide over the data-parallel "
                                                      "ranks beside MoE router losses (ghost rows)"),
         (r"^global_profiler.tool=torch profiles the steps of the synchronous loop", "profiling the fully-async loop"),
         (r"splits the packed stream of each micro-batch .* runs it padded", "sequence parallelism of padded "
                                                                          "micro-batches (use_remove_padding=false)"),
         (r"^[\w.]+=[^:]*: (?P<what>.*?) is not implemented yet in lathe", None)]


def short(label: str) -> str:
    """A problem as the README's table names it: a feature without its issue, unknown keys by their group."""
    if label.startswith("unknown key "):
        return "unknown keys " + ".".join(label.split()[-1].split(".")[:3]) + ".*"
    label = re.sub(r"[;,]\s*lathe issue \d+[^)]*\)", ")", label)
    label = re.sub(r"\s*\(lathe issue \d+[^)]*\)", "", label)
    for pattern, name in SHORT:
        if m := re.search(pattern, label):
            return name or m["what"]
    return label


def table() -> str:
    """The README's table: the scripts that do not load, grouped by what stops them."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for script in names():
        found = tuple(sorted({short(lab) for lab, _ in problems(script)}))
        groups.setdefault(found, []).append(script)
    loads = groups.pop((), [])
    lines = [f"{len(loads)} of {len(names())} load as written ({', '.join(loads)}).", "",
             "| what stops them | scripts |", "| --- | --- |"]
    for found, scripts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        stops = "; ".join(found).replace("|", "/")
        lines.append(f"| {stops} | {len(scripts)}: {', '.join(scripts)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
