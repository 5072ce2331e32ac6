"""Fixtures of the format tests: the documents under tests/data (made for these tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture
def document() -> Callable[[str], Any]:
    """Parse a document of tests/data by file name (a fresh copy each call)."""
    return lambda name: json.loads((DATA / name).read_text())


def state(store) -> tuple[Any, ...]:
    """What an import that fails must leave as it was: runs, heads, counts of everything."""
    report = store.fsck()
    runs = [(r.name, r.head_id, r.depth) for r in store.runs()]
    return runs, report.num_blobs, report.num_steps, report.num_notes, report.is_ok
