"""Blobs that name blobs: a workspace tree, which a model call's meta names.

`record --workspace` (kvtrace/workspace) keeps the agent's folder as a
tree blob whose entries name each file's blob. The step names only the
tree (meta `workspace`), so what a step reaches is its payload, its list
items, and, through a tree, the files. The store knows this much of a tree
(its kind, and which of its fields name blobs) so that a bundle carries the
files with the step (bundle.py) and fsck finds a tree or file that is gone
(fsck.py). What a tree means, and how one is made, is kvtrace/workspace's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import Connection

from kvtrace.store.objects import codec
from kvtrace.store.objects.encoding import is_address

TREE_KIND = "kvtrace-workspace"
TREE_VERSION = 1
WORKSPACE = "workspace"  # a model call's meta field: the address of its tree


def tree_of_body(value: Mapping[str, Any]) -> str | None:
    """The tree a decoded step body names in its meta, or None."""
    meta = value.get("meta")
    tree = meta.get(WORKSPACE) if isinstance(meta, Mapping) else None
    return tree if is_address(tree) else None


def files_of(data: bytes) -> list[str]:
    """The blob addresses a tree's entries name ([] for bytes that are no tree)."""
    try:
        value = json.loads(data)
    except ValueError:
        return []
    entries = value.get("entries") if isinstance(value, dict) else None
    if value.get("kind") != TREE_KIND or not isinstance(entries, list):
        return []
    return [entry["blob"] for entry in entries
            if isinstance(entry, dict) and is_address(entry.get("blob"))]


def reached(conn: Connection, trees: Iterable[str]) -> dict[str, list[str] | None]:
    """Each tree's files (None: the tree is not in the store)."""
    wanted = sorted(set(trees))
    found = codec.read(conn, wanted) if wanted else {}
    return {tree: files_of(found[tree]) if tree in found else None for tree in wanted}
