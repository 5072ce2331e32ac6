"""Taking a folder's snapshot into the store, cheaply when little changed.

`Snapshotter(store, folder).take()` walks the folder (never following a
link), keeps each file's bytes as a blob and returns the address of the
tree (tree.py) that names them. What makes the next snapshot cheap, as in
git's index:

- an index of each file's (mtime, size, inode, mode) and blob: a file whose
  stat is unchanged is not read again. A file changed within `RACY_NS` of
  the walk could change again under the same mtime, so it is read anyway;
- where the kernel can say which files changed (inotify, changes.py), only
  those are stat-ed again: the rest of the index stands, as git's index does
  with its fsmonitor. Whatever the events cannot vouch for, the folder is
  walked;
- blobs and trees this snapshotter stored are remembered, so an unchanged
  file or folder writes nothing;
- a new tree is stored as a delta against the previous one (store/objects/codec.py),
  so a tree of 1,000 paths where 3 changed costs what changed.

Not walked: `.git` and `.kvtrace` folders anywhere, and what the folder's
`.kvtraceignore` names (gitignore syntax, read with `pathspec` at each
snapshot). A file over `max_file_bytes` (default 10 MB) is kept by hash and
size only, and its entry says so.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.errors import UsageError
from kvtrace.store.objects.codec import Base
from kvtrace.store.objects.encoding import sha256_hex
from kvtrace.workspace.changes import is_text, open_watch
from kvtrace.workspace.tree import Entry, Tree, entry_bytes, parse, tree_bytes

if TYPE_CHECKING:
    from collections.abc import Iterable

    import pathspec

    from kvtrace.store import Store

IGNORE_FILE = ".kvtraceignore"
NEVER_WALKED = frozenset({".git", ".kvtrace"})
MAX_FILE_BYTES = 10_000_000
RACY_NS = 2_000_000_000  # a file changed this recently is read again (module docstring)


@dataclass(frozen=True, slots=True)
class _Known:
    """What the index keeps of a file: its stat, the entry it gave, and the entry's bytes."""

    stat: tuple[int, int, int, int]  # mtime_ns, size, inode, mode
    entry: Entry
    encoded: bytes
    # Changed within RACY_NS of the snapshot that read it: it could have changed again under
    # the same mtime, so the next snapshot reads it again (git's racily clean entries).
    is_racy: bool = False
    is_linked: bool = False  # more than one hard link: written through another, no event


class Snapshotter:
    """Snapshots of one folder into one store (one thread at a time: the store's writer)."""

    def __init__(self, store: Store, folder: Path, *,
                 max_file_bytes: int = MAX_FILE_BYTES, watch: bool = True) -> None:
        self.store = store
        self.folder = Path(folder).resolve()
        self.max_file_bytes = max_file_bytes
        self._watch = open_watch(self.folder, IGNORE_FILE) if watch else None
        self._is_watched = False  # a walk has added the watches the next `take` may trust
        self.num_walks = 0  # snapshots that walked the whole folder (for tests, benchmarks)
        self._index: dict[str, _Known] = {}
        self._linked: set[str] = set()  # the index's paths with other hard links
        self._order: list[str] = []  # the index's paths, sorted (a tree's order)
        self._stored: set[str] = set()  # blob addresses this snapshotter wrote or found
        self._last: tuple[str, bytes] | None = None  # the previous tree: address, bytes
        self.num_files_read = 0  # files whose bytes the last `take` read (for benchmarks)

    def take(self) -> str:
        """Snapshot the folder now; the tree's address. One that fails (a full store) keeps
        nothing, and the next one walks: the events it drained are gone."""
        try:
            return self._take()
        except BaseException:
            self._is_watched = False
            raise

    def _take(self) -> str:
        started = time.time_ns()
        self.num_files_read = 0
        changed, must_walk = self._changes()
        ignore = _ignore_spec(self.folder)  # after the events: an edit from now on is in them
        new_blobs: dict[str, bytes] = {}
        if must_walk:
            self.num_walks += 1
            found = self._walk(ignore)
            index: dict[str, _Known] = {}
            self._is_watched = self._watch is not None
        else:  # the rest of the index stands: only the changed paths are looked at again
            linked = [p for p in self._linked if p not in changed]  # stat-ed, not read
            found = self._stat(changed, ignore) + self._stat(linked, ignore)
            index = {p: known for p, known in self._index.items() if p not in changed}
            for path in linked:
                index.pop(path, None)
        num_reused = 0
        for path, info in found:
            seen = (info.st_mtime_ns, info.st_size, info.st_ino, info.st_mode)
            known = self._index.get(path)
            # A path the kernel says changed is read again, whatever its stat says.
            if (path not in changed and known is not None and known.stat == seen
                    and not known.is_racy):
                index[path] = known
                num_reused += 1
            else:
                entry = self._entry(path, info, new_blobs)
                index[path] = _Known(seen, entry, entry_bytes(entry),
                                     is_racy=started - seen[0] <= RACY_NS,
                                     is_linked=info.st_nlink > 1)
        if (num_reused == len(found) and index.keys() == self._index.keys()
                and self._last is not None):
            return self._last[0]  # no path added, gone or read again: the same tree
        order = self._order if index.keys() == self._index.keys() else sorted(index)
        data = tree_bytes([index[path].encoded for path in order])
        address = sha256_hex(data)
        if self._last is None or self._last[0] != address:  # else every blob is stored
            base = Base(*self._last) if self._last is not None else None
            with self.store.batch():  # one transaction for the files and their tree
                if new_blobs:
                    self.store.write_blobs(list(new_blobs.values()))
                self.store.write_blobs([data], base=base)
            self._stored.update(new_blobs)
            self._last = (address, data)
        # Kept only once stored: a snapshot that failed leaves the index as it was.
        self._index, self._order = index, order
        self._linked = {p for p, known in index.items() if known.is_linked}
        return address

    def close(self) -> None:
        """Stop watching the folder (the next `take` walks it)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._is_watched = False

    def _changes(self) -> tuple[set[str], bool]:
        """The paths the kernel says changed (read again, whatever their stat says), and
        whether to walk everything: without a watch, before a walk has set it up, or
        where the events cannot vouch for every change."""
        if self._watch is None or not self._is_watched or self._last is None:
            return set(), True
        return self._watch.changes()

    def _stat(self, paths: Iterable[str], ignore: pathspec.PathSpec | None
              ) -> list[tuple[str, os.stat_result]]:
        """The files and links among `paths` as they are now (the walk's rules: not
        ignored, no link followed); a path gone, or now of another kind, is left out."""
        found = []
        for rel in paths:
            if ignore and ignore.match_file(rel):
                continue
            try:
                info = os.lstat(self.folder / rel)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
                found.append((rel, info))
        return found

    def _walk(self, ignore: pathspec.PathSpec | None) -> list[tuple[str, os.stat_result]]:
        """Every file and link under the folder (relative '/' paths), not following links.
        Each folder is watched before it is listed (changes.py)."""
        found: list[tuple[str, os.stat_result]] = []
        pending = [""]
        while pending:
            prefix = pending.pop()
            if self._watch is not None:
                self._watch.add(prefix)
            try:
                with os.scandir(self.folder / prefix if prefix else self.folder) as it:
                    items = list(it)
            except OSError:
                continue  # vanished or unreadable: not in the snapshot
            for item in items:
                name = item.name
                if not name.isascii() and not is_text(name):
                    continue  # a name that is no UTF-8 cannot be named in a tree
                rel = prefix + name
                if item.is_dir(follow_symlinks=False):  # from the listing: no stat
                    if name in NEVER_WALKED or (ignore and ignore.match_file(rel + "/")):
                        continue
                    pending.append(rel + "/")
                    continue
                try:
                    info = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
                    if ignore and ignore.match_file(rel):
                        continue
                    found.append((rel, info))
        return found

    def _entry(self, path: str, info: os.stat_result, new_blobs: dict[str, bytes]) -> Entry:
        """The entry of a path the index cannot vouch for: read (and hashed) now."""
        full = self.folder / path
        mode = stat.S_IMODE(info.st_mode)
        unread = Entry(path, mode, 0, sha256=hashlib.sha256(b"").hexdigest(),
                       omitted="could not be read")  # vanished or unreadable meanwhile
        try:
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(full)
                return Entry(path, link=target if is_text(target) else "?")
            if info.st_size > self.max_file_bytes:
                return Entry(path, mode, info.st_size, sha256=_file_hash(full),
                             omitted=f"over {self.max_file_bytes:,} bytes")
            data = full.read_bytes()
        except OSError:
            return unread
        self.num_files_read += 1
        blob = sha256_hex(data)
        if blob not in self._stored:
            new_blobs[blob] = data
        return Entry(path, mode, len(data), blob=blob)


def workspace_folder(agent_folder: Path, spec: str) -> Path:
    """The folder `--workspace SPEC` names for an agent working in `agent_folder`: inside it
    (a UsageError otherwise, or when it is there and not a folder). It may not exist yet
    (an agent that makes it): until it does, its snapshot is empty."""
    base = Path(agent_folder).resolve()
    folder = (base / spec).resolve()
    if Path(spec).is_absolute() and not folder.is_relative_to(base):
        raise UsageError(f"--workspace {spec}: give a folder inside the agent's folder "
                         f"({base}), relative to it (e.g. --workspace .)")
    if not folder.is_relative_to(base):
        raise UsageError(f"--workspace {spec} leads out of the agent's folder ({base}): give a "
                         "folder inside it (e.g. --workspace .)")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--workspace {spec}: {folder} is not a folder")
    return folder


def _ignore_spec(folder: Path) -> pathspec.PathSpec | None:
    try:
        lines = (folder / IGNORE_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_of(store: Store, address: str) -> Tree:
    """The stored tree at `address`."""
    return parse(store.read_blob(address))
