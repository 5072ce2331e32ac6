"""A workspace travels with its run and is checked with it (issue 43): `export` bundles carry
the tree and its files, and `fsck` reports a tree or file the store does not hold."""

from __future__ import annotations

import io

from kvtrace import open_store
from kvtrace.workspace import Snapshotter, restore, tree_of
from kvtrace.workspace.tree import Entry, make_tree

MESSAGES = [{"role": "user", "content": "fix the bug"}]


def test_a_bundle_carries_the_workspace_and_restores_on_another_store(store, store_urls,
                                                                      tmp_path):
    folder = tmp_path / "w"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "app.py").write_text("print('hello')\n")
    (folder / "data.bin").write_bytes(bytes(range(256)))
    tree = Snapshotter(store, folder).take()
    store.run("agent").record_model_call(MESSAGES, "on it", model="m", workspace=tree)
    bundle = io.BytesIO()
    store.export_run("agent", bundle)

    with open_store(store_urls()) as other:
        other.import_bundle(io.BytesIO(bundle.getvalue()))
        assert other.fsck().is_ok
        out = tmp_path / "restored"
        restore(other, tree_of(other, tree), out)
        assert (out / "src" / "app.py").read_text() == "print('hello')\n"
        assert (out / "data.bin").read_bytes() == bytes(range(256))


def test_fsck_reports_a_workspace_tree_or_file_that_is_missing(store):
    absent_tree = "ab" * 32
    store.run("gone").record_model_call(MESSAGES, "ok", model="m", workspace=absent_tree)
    half = make_tree([Entry("a.txt", 0o644, 3, blob="cd" * 32)])
    store.write_blobs([half.encode()])
    store.run("half").record_model_call(MESSAGES, "ok", model="m", workspace=half.address)
    problems = store.fsck().problems
    assert any(f"workspace tree {absent_tree[:12]} is missing" in p for p in problems)
    assert any(f"workspace file blob {'cd' * 6} (tree {half.address[:12]}) is missing" in p
               for p in problems)
