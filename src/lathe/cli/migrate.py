"""``lathe migrate SCRIPT.sh``: read a verl launch script, say what lathe does with each key, print the command.

The script is read, never run (``lathe.cli.shell``). Each ``key=value`` of its trainer call gets a row: acts,
acts under lathe's name for it, no effect (and why), same either way, refused (the feature lathe lacks and the
fix) or unknown. Then the equivalent ``lathe train`` command: the keys that act, in the script's order (the ones
with no effect are left out, and so are refused ones). The exit status is 1 when any key is refused or unknown,
or the whole config breaks a rule, so a script can be checked in CI.

A script that runs verl's SFT trainer (`torchrun ... -m verl.trainer.sft_trainer`, or fsdp_sft_trainer) becomes a
`lathe sft` command: its keys as written, torchrun's `--nproc_per_node` / `--nnodes` as trainer.n_gpus_per_node /
trainer.nnodes, and what lathe sft says of the whole (its warnings as notes, its refusals: exit status 1).
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import TextIO

from lathe.cli.shell import read_script
from lathe.config.errors import ConfigError
from lathe.config.explain import ACTS, NO_EFFECT, RENAMED, SAME, explain

FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
SFT_TRAINERS = ("verl.trainer.sft_trainer", "verl.trainer.fsdp_sft_trainer")
_VALUE_WIDTH = 36


def migrate(path: str, *, env: dict[str, str] | None = None, out: TextIO = sys.stdout) -> int:
    text = Path(path).read_text()
    environment = dict(os.environ if env is None else env)
    environment.setdefault("DEVICE", "gpu")           # the scripts probe torch_npu to choose; lathe runs GPU/CPU
    environment.setdefault("VERL_USE_UV", "0")        # not `uv run`: lathe runs in the Python it is installed in
    script = read_script(text, environment)
    if script.module in SFT_TRAINERS:
        return _migrate_sft(path, script, out)
    flags = [a for a in script.args if a.startswith("--")]
    overrides = [a for a in script.args if not a.startswith("--") and a]
    result = explain([_placeholders(a, script.unresolved) for a in overrides])   # ${NAME}: no config reference

    width = min(max((len(r.key) for r in result.rows), default=10), 72)
    print(f"{path}: {script.module} (line {script.line}), {len(result.rows)} keys", file=out)
    for row in result.rows:
        value = row.value if len(row.value) <= _VALUE_WIDTH else row.value[:_VALUE_WIDTH - 3] + "..."
        verdict = row.verdict if not row.why else f"{row.verdict}: {row.why}"
        print(f"  {row.key:<{width}}  {value:<{_VALUE_WIDTH}}  {verdict}", file=out)

    notes = []
    if script.module == FULLY_ASYNC:
        notes.append("fully async: lathe runs its fully-async loop when the rollout has devices of its own "
                     "(actor_rollout_ref.rollout.n_gpus_per_node > 0), as this script's keys say")
    for flag in flags:
        notes.append(f"{flag}: not needed — lathe starts from its `base` preset (verl's defaults); "
                     f"the script's keys are applied over it")
    notes += _shell_notes(path, script)
    for problem in result.problems:
        notes.append(f"the whole config: {problem}")
    if notes:
        print("\nNotes:", file=out)
        for note in notes:
            print(f"  - {note}", file=out)

    kept = [text if row.command is None else row.command for text, row in zip(overrides, result.rows)
            if row.verdict in (ACTS, RENAMED) and row.command != ""]
    left = sum(row.verdict in (NO_EFFECT, SAME) for row in result.rows)
    print(f"\nThe lathe command ({len(kept)} keys; {left} with no effect in lathe left out):", file=out)
    print(" \\\n    ".join(["lathe train base"] + [_quote(k) for k in kept]), file=out)
    refused = result.refused
    if refused or result.problems:
        print(f"\nNot ready: {len(refused)} key(s) refused or unknown"
              f"{' and the config breaks a rule' if result.problems else ''} (above).", file=out)
        return 1
    return 0


def _shell_notes(path: str, script) -> list[str]:
    """What the reading left as written: variables never set, `$(...)` substitutions not run."""
    return ([f"${{{name}}} is never set in the script: set it in the environment (`{name}=... lathe migrate "
             f"{path}`) or edit the value in the command below" for name in script.unresolved]
            + [f"{command} is not run here: it stays in the value as written" for command in script.commands])


def _launcher_devices(launcher: list[str]) -> dict[str, str]:
    """torchrun's `--nproc_per_node` / `--nnodes` (either spelling, `=value` or the next word) as lathe sft's
    trainer.n_gpus_per_node / trainer.nnodes, where the script gives them as numbers."""
    keys = {"nproc_per_node": "trainer.n_gpus_per_node", "nproc-per-node": "trainer.n_gpus_per_node",
            "nnodes": "trainer.nnodes"}
    out = {}
    for i, word in enumerate(launcher):
        flag, sep, value = word.lstrip("-").partition("=")
        if word.startswith("--") and flag in keys:
            value = value if sep else (launcher[i + 1] if i + 1 < len(launcher) else "")
            if value.isdigit():
                out[keys[flag]] = value
    return out


def _migrate_sft(path: str, script, out: TextIO) -> int:
    """verl's SFT trainer call: its overrides as a `lathe sft` command (the device counts from torchrun's flags
    where the script does not set them), and whether lathe sft loads it (`load_sft_config`'s problems, if any)."""
    from lathe.config.sft import load_sft_config
    overrides = [_placeholders(a, script.unresolved) for a in script.args if a and not a.startswith("--")]
    given = {a.lstrip("+").partition("=")[0] for a in overrides}
    devices = {k: v for k, v in _launcher_devices(script.launcher).items() if k not in given}
    added = [f"{k}={v}" for k, v in devices.items() if not (k == "trainer.nnodes" and v == "1")]
    print(f"{path}: {script.module} (line {script.line}), {len(overrides)} keys", file=out)
    notes = [f"{k}={v}: from the launcher's {' '.join(script.launcher[:1])} flags (lathe sft starts its own "
             "workers; no torchrun)" for k, v in (a.split("=", 1) for a in added)]
    notes += _shell_notes(path, script)
    problems = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_sft_config(None, overrides + added)
        notes += [f"no effect: {w.message}" for w in caught]
    except ConfigError as err:
        problems = [line.strip() for line in str(err).splitlines() if line.strip()]
    if notes:
        print("\nNotes:", file=out)
        for note in notes:
            print(f"  - {note}", file=out)
    print(f"\nThe lathe command ({len(overrides) + len(added)} keys):", file=out)
    print(" \\\n    ".join(["lathe sft"] + [_quote(k) for k in overrides + added]), file=out)
    if problems:
        print("\nNot ready: lathe sft stops on:", file=out)
        for line in problems:
            print(f"  {line}", file=out)
        return 1
    return 0


def _placeholders(text: str, names: list[str]) -> str:
    for name in names:
        text = text.replace("${" + name + "}", f"<{name}>")
    return text


def _quote(text: str) -> str:
    """Shell-quoted for the printed command: in double quotes when the value holds an unrun $(command) or an
    unset ${NAME} (so the user's shell fills it in as the script's would have) or single quotes (a list of
    files); else as `shlex.quote` does."""
    if any(c in text for c in '"`\\') or not any(c in text for c in " '$*?[]{}()<>|&;"):
        return shlex.quote(text)
    if "$" not in text or "$(" in text or "${" in text:
        return f'"{text}"'
    return shlex.quote(text)
