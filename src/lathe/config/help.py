"""Per-key help: the text a field declares (``spec(help=...)``) plus what lathe does with the key when it is in
the support registry (``support.py``). Kept apart from ``tree`` so that ``tree`` (which ``support`` reads values
through) does not import ``support``."""

from __future__ import annotations

from typing import Any

from .coerce import hints_of
from .schema import LatheConfig
from .support import support_note
from .support_verl import verl_note
from .tree import dataclass_type, field_meta


def help_for(path: str) -> str:
    """Help text of a dotted key, with what lathe does with it when it is in the support registry; for a verl
    key lathe has no field for, what support_verl.py does with it ('' for unknown keys or keys without help)."""
    cls: Any = LatheConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        hints = hints_of(cls)
        if part not in hints:
            return verl_note(path)
        if i == len(parts) - 1:
            return " ".join(t for t in (field_meta(cls, part).get("help", ""), support_note(path)) if t)
        cls = dataclass_type(hints[part])
        if cls is None:
            return ""
    return ""
