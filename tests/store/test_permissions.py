"""A new SQLite store is private to its user (issue 23, item 12): every prompt and tool
result is in it, so the file (and SQLite's -wal and -shm files) is 0600 and a folder
made for it 0700, as the disk tier's KV blocks are 0600."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from kvtrace import open_store
from kvtrace.store import init_store


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The common 022 umask, under which files are born world-readable."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("opener", [open_store, init_store], ids=["open_store", "init_store"])
def test_a_new_store_and_its_wal_files_are_readable_by_their_owner_only(
    tmp_path, usual_umask, opener
):
    folder = tmp_path / "project" / ".kvtrace"
    path = folder / "store.db"
    with opener(f"sqlite:///{path}") as store:
        store.run("agent").record_model_call([{"role": "user", "content": "secret"}], "ok",
                                              model="m")
        files = [path, folder / "store.db-wal", folder / "store.db-shm"]
        assert all(p.is_file() for p in files)
        assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}
    assert _mode(folder) == 0o700
    assert _mode(tmp_path / "project") == 0o755  # only the store's own folder is made private


def test_an_existing_folder_and_store_keep_their_modes(tmp_path, usual_umask):
    path = tmp_path / "store.db"
    with open_store(f"sqlite:///{path}"):
        pass
    path.chmod(0o640)  # the owner chose to share it with a group
    with open_store(f"sqlite:///{path}", create=False):
        pass
    assert _mode(path) == 0o640
