"""Schema migrations: applied when a store opens, from the oldest schema up."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvtrace import open_store
from kvtrace.store.backend import MIGRATIONS_DIR, _upgrade, create_db_engine
from kvtrace.store.schema import SCHEMA_REVISION, metadata


def _script() -> ScriptDirectory:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return ScriptDirectory.from_config(config)


def test_code_expects_the_head_revision():
    assert _script().get_current_head() == SCHEMA_REVISION


def test_opening_an_empty_database_migrates_it_to_head(store_url):
    store = open_store(store_url)
    with store.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == SCHEMA_REVISION
        tables = set(sa.inspect(conn).get_table_names())
    assert set(metadata.tables) <= tables
    store.close()


def test_every_revision_applies_in_order_from_the_oldest(store_url):
    engine = create_db_engine(store_url)
    revisions = list(reversed(list(_script().walk_revisions())))
    for revision in revisions:
        with engine.begin() as conn:
            _upgrade(conn, revision.revision)
            assert MigrationContext.configure(conn).get_current_revision() == revision.revision
    engine.dispose()
    store = open_store(store_url)  # a store at head opens without migrating again
    assert store.run("main").record_tool_call("t", {}, 1).depth == 1
    store.close()


def test_migration_files_are_named_after_their_revision():
    for revision in _script().walk_revisions():
        assert Path(revision.path).stem == revision.revision


def test_skip_pointer_migration_fills_existing_steps(tmp_path):
    from kvtrace.store import encoding

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_db_engine(url)
    with engine.begin() as conn:
        _upgrade(conn, "0001_initial")
        parent = None
        for depth in range(1, 12):
            body = encoding.step_body(
                kind="note", parent=parent, payload={}, raw=[], meta={"d": depth}
            )
            step_id = encoding.sha256_hex(body)
            conn.execute(
                sa.text(
                    "INSERT INTO steps (id, parent_id, kind, depth, body, recorded_at) "
                    "VALUES (:i, :p, 'note', :d, :b, 0)"
                ),
                {"i": step_id, "p": parent, "d": depth, "b": body},
            )
            parent = step_id
        conn.execute(
            sa.text("INSERT INTO refs (name, head, created_at) VALUES ('old', :h, 0)"),
            {"h": parent},
        )
        conn.execute(  # kvtrace logs every ref it creates; fsck checks that it did
            sa.text(
                "INSERT INTO reflog (ref, old_head, new_head, reason, message, created_at) "
                "VALUES ('old', NULL, :h, 'create', 'old store', 0)"
            ),
            {"h": parent},
        )
    engine.dispose()
    store = open_store(url)
    assert store.fsck().problems == []
    assert store.show("old@3").meta == {"d": 3}
    assert store.run("old").record_note("new").depth == 12
    store.close()


def test_a_run_paused_before_the_pause_index_stays_paused(store_url):
    from kvtrace.errors import RunPausedError

    engine = create_db_engine(store_url)
    with engine.begin() as conn:
        _upgrade(conn, "0003_message_lists")
        conn.execute(sa.text("INSERT INTO refs (name, head, created_at) VALUES ('old', NULL, 0)"))
        for reason in ("create", "pause", "resume", "pause"):
            conn.execute(
                sa.text(
                    "INSERT INTO reflog (ref, old_head, new_head, reason, message, created_at) "
                    "VALUES ('old', NULL, NULL, :r, :m, 0)"
                ),
                {"r": reason, "m": f"a {reason}"},
            )
    engine.dispose()
    store = open_store(store_url)  # builds ix_reflog_pauses over the entries already there
    assert store.is_paused("old")
    with pytest.raises(RunPausedError):
        store.run("old").record_note("refused")
    store.resume("old")
    assert store.run("old").record_note("now").depth == 1
    store.close()


def test_refs_head_index_is_built_over_the_runs_already_there(store_url, monkeypatch):
    from kvtrace.store import bodies

    # Runs recorded as 0005 wrote them (bodies as they are), then what 0006 and 0007 added
    # dropped: as 0005 left a store.
    monkeypatch.setattr(bodies, "encode", lambda body: (body, None))
    old = open_store(store_url)
    old.run("main").record_tool_call("t", {}, 1)
    old.fork("main", "side")
    monkeypatch.undo()
    with old.engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_refs_head"))
        conn.execute(sa.text("ALTER TABLE steps DROP COLUMN body_codec"))
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0005_blob_codecs'"))
    old.close()
    store = open_store(store_url)  # migrates 0005 -> head
    with store.engine.connect() as conn:
        indexes = {index["name"] for index in sa.inspect(conn).get_indexes("refs")}
    assert "ix_refs_head" in indexes
    assert [row.heads for row in store.graph("main")] == [["main", "side"]]
    store.close()
