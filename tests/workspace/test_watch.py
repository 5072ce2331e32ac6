"""Snapshots from the kernel's change events (workspace/changes.py) give the tree a full walk
gives, after every kind of change, on a real folder with real inotify watches.

After each change, the watched snapshotter's tree is compared with a new snapshotter's
that walks and reads everything. A change to files and links in known folders is taken
from the events (no walk); a folder made, removed or moved, an edited `.kvtraceignore` or
an overflowing queue makes the next snapshot walk, and the one after that trusts the
events again.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from kvtrace.workspace import Snapshotter
from kvtrace.workspace.changes import open_watch
from tests.workspace.conftest import age


def _has_inotify() -> bool:
    watch = open_watch(Path("."), ".kvtraceignore") if sys.platform.startswith("linux") else None
    if watch is None:
        return False
    watch.close()
    return True


pytestmark = pytest.mark.skipif(not _has_inotify(), reason="inotify is Linux's, and needs "
                                "inotify_simple (the serve extra)")


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "work"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("A = 1\n")
    (root / "src" / "b.py").write_text("B = 2\n")
    (root / "notes.md").write_text("# notes\n")
    (root / ".kvtraceignore").write_text("*.log\n")
    age(root, seconds=60)
    return root


def _edit(path, text):
    path.write_text(text)


def _same_size_same_mtime(path):
    """New bytes of the same size under the old mtime: what a stat index cannot see."""
    before = path.stat()
    path.write_bytes(path.read_bytes().upper())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


FILE_CHANGES = [
    ("a file written", lambda r: _edit(r / "src" / "a.py", "A = 10\n")),
    ("a file made", lambda r: _edit(r / "src" / "c.py", "C = 3\n")),
    ("a file removed", lambda r: (r / "src" / "b.py").unlink()),
    ("a file renamed", lambda r: (r / "notes.md").rename(r / "NOTES.md")),
    ("a file moved to another folder", lambda r: (r / "src" / "a.py").rename(r / "a.py")),
    ("a mode set", lambda r: (r / "notes.md").chmod(0o600)),
    ("a link made", lambda r: os.symlink("notes.md", r / "link")),
    ("an ignored file written", lambda r: _edit(r / "debug.log", "noise\n")),
    ("same size, same mtime", lambda r: _same_size_same_mtime(r / "notes.md")),
]
FOLDER_CHANGES = [
    ("a folder made with files", lambda r: ((r / "new").mkdir(), _edit(r / "new" / "x", "x"))),
    ("a folder removed", lambda r: shutil.rmtree(r / "src")),
    ("a folder renamed", lambda r: (r / "src").rename(r / "lib")),
    (".kvtraceignore edited", lambda r: _edit(r / ".kvtraceignore", "*.log\n*.md\n")),
]


@pytest.mark.parametrize(("what", "change"), FILE_CHANGES, ids=[c[0] for c in FILE_CHANGES])
def test_a_file_change_is_taken_from_the_events_as_a_walk_would_see_it(store, folder, what,
                                                                       change):
    watched = Snapshotter(store, folder)
    first = watched.take()
    assert watched.num_walks == 1
    change(folder)
    after = watched.take()
    assert watched.num_walks == 1  # no walk: the events said which paths to look at
    assert after == Snapshotter(store, folder, watch=False).take()  # what a walk gives
    if what != "an ignored file written":
        assert after != first
    watched.close()


@pytest.mark.parametrize(("what", "change"), FOLDER_CHANGES,
                         ids=[c[0] for c in FOLDER_CHANGES])
def test_a_folder_change_makes_the_next_snapshot_walk_then_events_again(store, folder, what,
                                                                         change):
    watched = Snapshotter(store, folder)
    first = watched.take()
    change(folder)
    after = watched.take()
    assert watched.num_walks == 2 and after != first
    assert after == Snapshotter(store, folder, watch=False).take()
    # The walk watched the folders it found: the next file change needs no walk.
    deepest = max((p for p in folder.rglob("*") if p.is_dir()), default=folder,
                  key=lambda p: len(p.parts))
    _edit(deepest / "after.txt", "changed again\n")  # in a folder the walk found
    again = watched.take()
    assert watched.num_walks == 2 and again != after
    assert again == Snapshotter(store, folder, watch=False).take()
    watched.close()


def test_a_stat_index_alone_misses_what_the_events_catch(store, folder):
    """New bytes of the same size under the old mtime: the walk's stat index keeps the old
    blob (git's racy-git limit), the watched snapshot reads the file again."""
    walked, watched = Snapshotter(store, folder, watch=False), Snapshotter(store, folder)
    before = walked.take()
    assert watched.take() == before
    _same_size_same_mtime(folder / "notes.md")
    assert walked.take() == before  # stale: the stat did not change
    assert watched.take() != before
    watched.close()


def test_many_changes_between_two_snapshots_and_none_lost(store, folder):
    watched = Snapshotter(store, folder)
    watched.take()
    for i in range(200):
        _edit(folder / "src" / f"gen_{i:03}.py", f"N = {i}\n")
    for i in range(0, 200, 3):
        (folder / "src" / f"gen_{i:03}.py").unlink()
    assert watched.take() == Snapshotter(store, folder, watch=False).take()
    assert watched.num_walks == 1
    watched.close()


def test_a_folder_that_appears_later_is_walked_then_watched(store, tmp_path):
    folder = tmp_path / "later"
    watched = Snapshotter(store, folder)
    empty = watched.take()  # no folder yet: an empty tree, nothing watched
    folder.mkdir()
    _edit(folder / "made.txt", "made\n")
    made = watched.take()
    assert made != empty and watched.num_walks == 2
    _edit(folder / "made.txt", "made again\n")
    assert watched.take() == Snapshotter(store, folder, watch=False).take()
    assert watched.num_walks == 2
    watched.close()


def test_without_the_watch_every_snapshot_walks(store, folder):
    walked = Snapshotter(store, folder, watch=False)
    walked.take()
    _edit(folder / "src" / "a.py", "A = 11\n")
    walked.take()
    assert walked.num_walks == 2


def test_past_the_watch_limit_it_walks_from_then_on_and_keeps_no_watch(store, folder):
    """The kernel refuses a watch past the user's limit (ENOSPC): the limit is stood for by
    a real inotify that refuses the third watch (lowering the machine's own limit would
    reach every process on it)."""
    import errno

    from inotify_simple import INotify, flags

    from kvtrace.workspace.changes import FolderWatch

    class Limited(INotify):
        added = 0

        def add_watch(self, path, mask):
            if Limited.added >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            Limited.added += 1
            return super().add_watch(path, mask)

    for name in ("x", "y", "z"):
        (folder / name).mkdir()
        _edit(folder / name / "f.txt", name)
    watched = Snapshotter(store, folder)
    watched._watch = FolderWatch(Limited(), flags, folder, ".kvtraceignore")
    watched.take()
    for round_ in range(3):
        _edit(folder / "x" / "f.txt", f"round {round_}")
        assert watched.take() == Snapshotter(store, folder, watch=False).take()
    assert watched.num_walks == 4 and Limited.added == 2  # no watch tried past the limit
    assert not watched._watch._folders  # the two it had were dropped
    watched.close()


def test_a_file_written_through_another_hard_link_is_seen(store, folder, tmp_path):
    """A write through a link outside the folder raises no event in it: a file with more
    than one link is stat-ed at every snapshot."""
    outside = tmp_path / "outside.py"
    os.link(folder / "src" / "a.py", outside)
    watched = Snapshotter(store, folder)
    before = watched.take()
    time.sleep(0.01)
    outside.write_text("A = 'through the other link'\n")
    after = watched.take()
    assert after != before and watched.num_walks == 1
    assert after == Snapshotter(store, folder, watch=False).take()
    watched.close()
