"""Which files of a folder changed since the last snapshot, from the kernel (inotify), so a
snapshot need not stat every file: what git's fsmonitor does for its index.

The snapshot adds a watch on each folder it walks, before it lists that folder, so no
change after the listing goes unseen. Events are read when the next snapshot asks
(`changes`), not by a thread: the kernel queues each one as the change happens, so
every change made before a snapshot starts is in the queue that snapshot drains.

Only changes to files and links in watched folders are taken one by one. Anything the
events cannot say exactly makes the answer None, and the snapshot then walks the whole
folder as it always could:

- a folder made, removed or moved;
- a watch lost, or the queue overflowing;
- `.kvtraceignore` changed;
- a name that is no UTF-8.

A file written through another of its hard links raises no event here; the snapshot
stats every file that has more than one link, at every snapshot. A file written through a
memory mapping raises none either, and is not seen while the folder is watched.

`Snapshotter(watch=False)` always walks. Linux only, and only where `inotify_simple`
(kvtrace's `serve` extra) is installed and the kernel grants the watches (the user's
watch limit, `fs.inotify.max_user_watches`); elsewhere `open_watch` gives None and every
snapshot walks.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from pathlib import Path
from typing import Any

# A file's entry may have changed: made, written, closed after writing, its mode or times
# set, removed, or moved in or out. A folder removed or moved itself loses its watch.
_FILE_EVENTS = ("CREATE", "MODIFY", "CLOSE_WRITE", "ATTRIB", "DELETE", "MOVED_FROM",
                "MOVED_TO", "DELETE_SELF", "MOVE_SELF")


class FolderWatch:
    """The inotify watches over one folder's tree (module docstring). One thread at a
    time: the snapshotter's."""

    def __init__(self, inotify: Any, flags: Any, root: Path, ignore_file: str) -> None:
        self._inotify = inotify
        self._flags = flags
        self._root = root
        self._ignore_file = ignore_file
        self._mask = 0
        for name in _FILE_EVENTS:
            self._mask |= getattr(flags, name)
        self._folders: dict[int, str] = {}  # watch descriptor -> its folder ('' or 'a/b/')
        self._watched: set[str] = set()
        self._lost = False  # a watch could not be added: the events cannot vouch for all
        self._is_over_limit = False  # the user's watch limit: walk from now on, watch nothing

    def add(self, prefix: str) -> None:
        """Watch the folder `prefix` ('' for the root, else 'a/b/'), before it is listed."""
        if prefix in self._watched or self._is_over_limit:
            return
        try:
            wd = self._inotify.add_watch(str(self._root / prefix), self._mask)
        except OSError as exc:  # gone meanwhile, or the user's watch limit
            self._lost = True
            # Past the limit, every walk would add thousands of watches to drop them again.
            self._is_over_limit = exc.errno == errno.ENOSPC
            return
        self._folders[wd] = prefix
        self._watched.add(prefix)

    def changes(self) -> tuple[set[str], bool]:
        """The paths ('a/b.txt') whose entries may have changed since last asked, and whether
        the events cannot vouch for every change (module docstring): then walk, which
        `add`s the watches again. The paths are given either way: a walk reads them again
        whatever their stat says."""
        flags = self._flags
        if self._is_over_limit:
            if self._folders:
                self._forget()
            return set(), True
        try:
            events = self._inotify.read(timeout=0)
        except OSError:
            events, self._lost = [], True
        changed: set[str] = set()
        for event in events:
            prefix = self._folders.get(event.wd)
            if (event.mask & (flags.Q_OVERFLOW | flags.IGNORED | flags.DELETE_SELF
                              | flags.MOVE_SELF | flags.ISDIR) or prefix is None
                    or (not prefix and event.name == self._ignore_file)):
                self._lost = True
            if prefix is not None and event.name and is_text(event.name):
                changed.add(prefix + event.name)
            elif event.name:
                self._lost = True  # a name that is no UTF-8: the walk leaves it out
        if self._lost:
            self._forget()
            return changed, True
        return changed, False

    def close(self) -> None:
        self._inotify.close()

    def _forget(self) -> None:
        """Drop every watch: the walk that follows adds them again, in the order it lists."""
        for wd in list(self._folders):
            with contextlib.suppress(OSError):  # already gone with its folder
                self._inotify.rm_watch(wd)
        self._inotify.read(timeout=0)  # the removals' own IGNORED events
        self._folders.clear()
        self._watched.clear()
        self._lost = False  # the limit, if reached, stays: `_is_over_limit`


def open_watch(root: Path, ignore_file: str) -> FolderWatch | None:
    """A watch over `root`'s tree, or None where inotify is not to be had (module docstring)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        from inotify_simple import INotify, flags
    except ImportError:
        return None
    try:
        inotify = INotify()
    except OSError:  # the user's limit of inotify instances
        return None
    return FolderWatch(inotify, flags, root, ignore_file)


def is_text(name: str) -> bool:
    """Whether a name from the file system is valid UTF-8 (else it holds surrogate escapes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
