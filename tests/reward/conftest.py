"""Shared helpers for reward tests: real data from ../shared/data, skipped when absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
if not DATA.is_dir():  # the checkout may live elsewhere; /work/shared is the usual place
    DATA = Path("/work/shared/data")


def _load_jsonl(relative: str) -> list[dict]:
    """Rows of a shared data file, or skip the test saying which file is missing."""
    path = DATA / relative
    if not path.is_file():
        pytest.skip(f"real data {path} is not present")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def load_jsonl():
    """``load_jsonl("gsm8k/test.jsonl")`` -> rows; skips the test when the file is absent."""
    return _load_jsonl
