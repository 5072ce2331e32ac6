"""Workspace snapshots of a real folder tree, on both store backends (issue 43, items 1-2).

A snapshot keeps every file once as a blob and names them in a tree; an
unchanged folder is the same tree and reads no file again (the stat index);
a changed file is the only one read; links are kept as links; `.git`,
`.kvtrace` and `.kvtraceignore`'s patterns are left out; a file over the
limit is kept by hash and size. Restore writes the files back byte for
byte, and never outside its folder.
"""

from __future__ import annotations

import json
import os

import pytest
import sqlalchemy as sa

from kvtrace.errors import IntegrityError, UsageError
from kvtrace.store.db.schema import blobs
from kvtrace.workspace import Snapshotter, changes, restore, tree_of
from kvtrace.workspace.snapshot import workspace_folder
from kvtrace.workspace.tree import parse
from tests.workspace.conftest import age


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "README.md").write_text("# demo\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "data.bin").write_bytes(bytes(range(256)) * 4)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "build").mkdir()
    (root / "build" / "out.o").write_bytes(b"\x7fELF")
    (root / "debug.log").write_text("noise\n")
    (root / ".kvtraceignore").write_text("build/\n*.log\n")
    (root / "big.dat").write_bytes(b"x" * 5000)
    os.symlink("README.md", root / "readme-link")
    os.symlink("/etc/passwd", root / "outside")
    age(root)
    return root


def test_a_snapshot_keeps_files_links_and_modes_and_leaves_out_what_is_ignored(store, project):
    shots = Snapshotter(store, project, max_file_bytes=4096)
    tree = tree_of(store, shots.take())
    by_path = tree.by_path()
    assert sorted(by_path) == [".kvtraceignore", "README.md", "big.dat", "data.bin", "outside",
                               "readme-link", "run.sh", "src/pkg/mod.py"]
    assert by_path["run.sh"].mode == 0o755 and by_path["README.md"].mode & 0o777 == 0o644
    assert by_path["readme-link"].link == "README.md" and by_path["outside"].link == "/etc/passwd"
    big = by_path["big.dat"]
    assert big.blob is None and big.size == 5000 and big.omitted and big.sha256
    assert store.read_blob(by_path["data.bin"].blob) == (project / "data.bin").read_bytes()


def test_an_unchanged_folder_is_the_same_tree_and_reads_no_file(store, project):
    shots = Snapshotter(store, project)
    first = shots.take()
    assert shots.num_files_read == 6
    assert shots.take() == first and shots.num_files_read == 0
    (project / "src" / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    second = shots.take()
    assert second != first and shots.num_files_read == 1
    [change] = changes(tree_of(store, first), tree_of(store, second))
    assert (change.path, change.status) == ("src/pkg/mod.py", "changed")
    # Another snapshotter (a later run) of the same folder: the same tree, the same blobs.
    age(project)
    assert Snapshotter(store, project).take() == second


def test_a_new_tree_is_kept_as_a_delta_of_the_previous_one(store, tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(300):
        (folder / f"file_{i:04}.txt").write_text(f"content {i}\n" * 20)
    age(folder)
    shots = Snapshotter(store, folder)
    first = shots.take()
    (folder / "file_0007.txt").write_text("changed\n")
    second = shots.take()
    with store.engine.connect() as conn:
        sizes = dict(conn.execute(sa.select(blobs.c.hash, sa.func.length(blobs.c.data))
                                  .where(blobs.c.hash.in_([first, second]))).all())
    assert sizes[second] < sizes[first] / 10  # the delta: what changed, not 300 entries


def test_restore_writes_the_files_back_byte_for_byte(store, project, tmp_path):
    tree = tree_of(store, Snapshotter(store, project, max_file_bytes=4096).take())
    out = tmp_path / "restored"
    done = restore(store, tree, out)
    assert (done.num_files, done.num_links, done.omitted) == (5, 2, ["big.dat"])
    for name in ("README.md", "data.bin", "run.sh", "src/pkg/mod.py", ".kvtraceignore"):
        assert (out / name).read_bytes() == (project / name).read_bytes()
    assert os.readlink(out / "outside") == "/etc/passwd"
    assert (out / "run.sh").stat().st_mode & 0o777 == 0o755
    assert not (out / ".git").exists() and not (out / "build").exists()

    with pytest.raises(UsageError, match="not empty: give --force"):
        restore(store, tree, out)
    (out / "README.md").write_text("edited\n")
    restore(store, tree, out, force=True)
    assert (out / "README.md").read_text() == "# demo\n"


def test_a_tree_cannot_name_a_path_outside_its_folder():
    for bad in ("../x", "/etc/passwd", "a/../../b", "a//b", "./a", ""):
        entry = {"blob": "00", "mode": 420, "path": bad, "size": 0}
        data = json.dumps({"entries": [entry], "kind": "kvtrace-workspace", "v": 1})
        with pytest.raises(IntegrityError):
            parse(data.encode())


def test_restore_never_writes_through_a_link(store, tmp_path):
    inside = tmp_path / "w"
    (inside / "sub").mkdir(parents=True)
    (inside / "sub" / "f.txt").write_text("ok\n")
    tree = tree_of(store, Snapshotter(store, inside).take())
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "sub")
    with pytest.raises(UsageError, match="is a link"):
        restore(store, tree, out, force=True)
    assert not list(elsewhere.iterdir())


def test_a_workspace_must_be_a_folder_inside_the_agents_folder(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    assert workspace_folder(tmp_path, ".") == tmp_path.resolve()
    assert workspace_folder(tmp_path, "later") == (tmp_path / "later").resolve()
    with pytest.raises(UsageError, match="leads out of the agent's folder"):
        workspace_folder(tmp_path, "..")
    with pytest.raises(UsageError, match="is not a folder"):
        workspace_folder(tmp_path, "file.txt")
    with pytest.raises(UsageError, match="inside the agent's folder"):
        workspace_folder(tmp_path, "/etc")


def test_a_tree_from_kept_entry_bytes_is_its_canonical_json(store, project):
    from kvtrace.store.objects.encoding import canonical_json

    tree = tree_of(store, Snapshotter(store, project, max_file_bytes=4096).take())
    whole = canonical_json({"v": 1, "kind": "kvtrace-workspace",
                            "entries": [entry.to_json() for entry in tree.entries]})
    assert tree.encode() == whole


def test_a_name_that_is_no_utf8_is_left_out_not_fatal(store, tmp_path):
    folder = tmp_path / "names"
    folder.mkdir()
    (folder / "ok.txt").write_text("fine\n")
    with open(os.path.join(os.fsencode(folder), b"bad-\xff.txt"), "wb") as fh:
        fh.write(b"x")
    tree = tree_of(store, Snapshotter(store, folder).take())
    assert [entry.path for entry in tree.entries] == ["ok.txt"]
