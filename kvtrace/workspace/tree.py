"""A workspace snapshot's tree: every path of a folder with its mode and content's blob.

A tree is one blob of the store: the canonical JSON (store/objects/encoding.py) of
`{"v": 1, "kind": "kvtrace-workspace", "entries": [ENTRY, ...]}`, entries
sorted by path. Its address is the snapshot's name, so an unchanged folder
gives the same tree, and an unchanged file the same blob, in every step and
run. An entry is one of:

- a file: `{"path", "mode", "size", "blob"}` (`mode`: the permission bits;
  `blob`: the address of its bytes, stored as a blob of their own);
- a file over the size limit: `{"path", "mode", "size", "sha256",
  "omitted": REASON}`: kept by hash and size only, never restored;
- a symbolic link: `{"path", "link": TARGET}`, kept as the link, never
  followed.

Paths are relative, '/'-separated, without '.' or '..' parts: `parse`
refuses a tree that breaks this, so a tree from anywhere (an imported
bundle) cannot name a path outside the folder it is restored into.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kvtrace.errors import IntegrityError
from kvtrace.store.objects.encoding import canonical_json, sha256_hex
from kvtrace.store.objects.trees import TREE_KIND, TREE_VERSION


@dataclass(frozen=True, slots=True)
class Entry:
    """One path of a snapshot (module docstring: which fields each kind has)."""

    path: str
    mode: int = 0o644
    size: int = 0
    blob: str | None = None  # a file's bytes
    sha256: str | None = None  # an omitted file's hash
    omitted: str | None = None  # why its bytes were not kept
    link: str | None = None  # a symbolic link's target

    @property
    def is_link(self) -> bool:
        return self.link is not None

    @property
    def content_id(self) -> str | None:
        """What compares two versions of the path: the blob, the hash, or the link."""
        if self.link is not None:
            return f"link:{self.link}"
        return self.blob or self.sha256

    def to_json(self) -> dict[str, Any]:
        if self.link is not None:
            return {"path": self.path, "link": self.link}
        data: dict[str, Any] = {"path": self.path, "mode": self.mode, "size": self.size}
        if self.blob is not None:
            data["blob"] = self.blob
        else:
            data["sha256"], data["omitted"] = self.sha256, self.omitted
        return data


@dataclass(frozen=True, slots=True)
class Tree:
    """A snapshot: its entries by path."""

    entries: tuple[Entry, ...]

    def encode(self) -> bytes:
        return tree_bytes([entry_bytes(entry) for entry in self.entries])

    @property
    def address(self) -> str:
        return sha256_hex(self.encode())

    def by_path(self) -> dict[str, Entry]:
        return {entry.path: entry for entry in self.entries}

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.entries if entry.link is None)


def entry_bytes(entry: Entry) -> bytes:
    """An entry's canonical JSON (unchecked: only str and int, names valid UTF-8, which
    snapshot.py makes sure of); a snapshotter keeps it with the entry."""
    return canonical_json(entry.to_json(), is_checked=False)


def tree_bytes(entries: list[bytes]) -> bytes:
    """A tree's canonical JSON from its entries' (`entry_bytes`, sorted by path): the bytes
    `canonical_json` gives the whole object ("entries" < "kind" < "v"), without encoding
    again the entries a snapshot kept (a test holds the two equal)."""
    return b'{"entries":[' + b",".join(entries) + b'],"kind":"%s","v":%d}' % (
        TREE_KIND.encode(), TREE_VERSION)


def make_tree(entries: Iterable[Entry]) -> Tree:
    return Tree(tuple(sorted(entries, key=lambda entry: entry.path)))


@dataclass(frozen=True, slots=True)
class Change:
    """A path that differs between two snapshots: 'added', 'removed' or 'changed'."""

    path: str
    status: str
    before: Entry | None
    after: Entry | None


def changes(before: Tree, after: Tree) -> list[Change]:
    """The paths added, removed and changed from `before` to `after`, by path."""
    old, new = before.by_path(), after.by_path()
    found = []
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path), new.get(path)
        if a is None:
            found.append(Change(path, "added", None, b))
        elif b is None:
            found.append(Change(path, "removed", a, None))
        elif a.content_id != b.content_id or a.mode != b.mode:
            found.append(Change(path, "changed", a, b))
    return found


def parse(data: bytes) -> Tree:
    """A stored tree, checked (module docstring); IntegrityError when it is no tree."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise IntegrityError(f"a workspace tree is not JSON: {exc}") from None
    if not isinstance(value, dict) or value.get("kind") != TREE_KIND:
        raise IntegrityError("the blob is not a workspace tree")
    if value.get("v") != TREE_VERSION:
        raise IntegrityError(f"workspace tree version {value.get('v')!r} is not known")
    entries = value.get("entries")
    if not isinstance(entries, list):
        raise IntegrityError("a workspace tree has no entries list")
    return Tree(tuple(_entry(item) for item in entries))


def _entry(item: Any) -> Entry:
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        raise IntegrityError(f"a workspace entry is not an object with a path: {item!r:.80}")
    path = item["path"]
    parts = PurePosixPath(path).parts
    if (not path or path.startswith("/") or "\\" in path or "\x00" in path
            or any(part in (".", "..") for part in parts) or "/".join(parts) != path):
        raise IntegrityError(f"a workspace entry's path is not a plain relative path: {path!r}")
    if isinstance(item.get("link"), str):
        return Entry(path, link=item["link"])
    mode, size = item.get("mode"), item.get("size")
    if not isinstance(mode, int) or not isinstance(size, int) or size < 0:
        raise IntegrityError(f"workspace entry {path!r} has no mode or size")
    blob, digest = item.get("blob"), item.get("sha256")
    if isinstance(blob, str):
        return Entry(path, mode & 0o7777, size, blob=blob)
    if isinstance(digest, str):
        return Entry(path, mode & 0o7777, size, sha256=digest,
                     omitted=str(item.get("omitted") or "omitted"))
    raise IntegrityError(f"workspace entry {path!r} names no content")
