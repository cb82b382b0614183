"""``lathe migrate SCRIPT.sh``: read a verl launch script, say what lathe does with each key, print the command.

The script is read, never run (``lathe.cli.shell``). Each ``key=value`` of its trainer call gets a row: acts,
acts under lathe's name for it, no effect (and why), same either way, refused (the feature lathe lacks and the
fix) or unknown. Then the equivalent ``lathe train`` command: the keys that act, in the script's order (the ones
with no effect are left out, and so are refused ones). The exit status is 1 when any key is refused or unknown,
or the whole config breaks a rule, so a script can be checked in CI.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import TextIO

from lathe.cli.shell import read_script
from lathe.config.explain import ACTS, NO_EFFECT, RENAMED, SAME, explain

FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
_VALUE_WIDTH = 36


def migrate(path: str, *, env: dict[str, str] | None = None, out: TextIO = sys.stdout) -> int:
    text = Path(path).read_text()
    environment = dict(os.environ if env is None else env)
    environment.setdefault("DEVICE", "gpu")           # the scripts probe torch_npu to choose; lathe runs GPU/CPU
    environment.setdefault("VERL_USE_UV", "0")        # not `uv run`: lathe runs in the Python it is installed in
    script = read_script(text, environment)
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
    for name in script.unresolved:
        notes.append(f"${{{name}}} is never set in the script: set it in the environment "
                     f"(`{name}=... lathe migrate {path}`) or edit the value in the command below")
    for command in script.commands:
        notes.append(f"{command} is not run here: it stays in the value as written")
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
