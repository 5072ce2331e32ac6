"""Schema migrations: applied when a store opens, from the oldest schema up."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvtrace import open_store
from kvtrace.store.db.backend import MIGRATIONS_DIR, _upgrade, create_db_engine
from kvtrace.store.db.schema import SCHEMA_REVISION, metadata
from tests.store.old_stores import copy_as


def _downgrade(conn: sa.Connection, target: str) -> None:
    from alembic import command

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = conn
    command.downgrade(config, target)


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
    from kvtrace.store.objects import encoding

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


def test_refs_head_index_is_built_over_the_runs_already_there(store_urls):
    recorded = open_store(store_urls())
    recorded.run("main").record_tool_call("t", {}, 1)
    recorded.fork("main", "side")
    url = store_urls()
    copy_as(recorded, url, "0005_blob_codecs")  # as 0005 left a store: no ix_refs_head
    recorded.close()
    store = open_store(url)  # migrates 0005 -> head
    with store.engine.connect() as conn:
        indexes = {index["name"] for index in sa.inspect(conn).get_indexes("refs")}
    assert "ix_refs_head" in indexes
    assert [row.heads for row in store.graph("main")] == [["main", "side"]]
    store.close()


# -- 0008_binary_ids: addresses as raw bytes --------------------------------------------


def _record_everything(store) -> None:
    """A store with every kind of row: blobs (small, compressed, raw), steps with parents,
    skip pointers and message lists, forks, a revert, a pause and a resume, notes."""
    from kvtrace.bench.conversations import tool_calling_conversation

    main = store.run("main")
    for call in tool_calling_conversation(12):
        main.record_model_call(call.messages, call.response, model="m", tools=call.tools)
        main.record_tool_call("lookup", {"q": len(call.messages)}, {"found": "x" * 300})
    main.record("http", {"response": {"status": 200}}, raw={"body": b"\x00raw bytes\xff"})
    store.fork("main@5", "side")
    store.run("side").record_note("a step of the fork")
    store.revert("main", to="main@20")
    store.pause("main", reason="look at it")
    store.resume("main")
    store.run("main").record_tool_call("t", {}, 1)
    store.note("main@3", "looked at this", author="supervisor")
    store.note("side", "and this")
    store.run("empty")


def _everything(store) -> dict:
    """What a user reads back: every run, each step of it (content, messages and all),
    every reflog entry, note and blob, and every row of every table as the API's types."""
    runs = store.runs()
    steps = {info.name: store.path(info.name) for info in runs if info.depth}
    ids = sorted({step.id for path in steps.values() for step in path})
    addresses = sorted({a for path in steps.values() for s in path for a in s.payload.values()})
    with store.engine.connect() as conn:
        rows = {name: [tuple(row) for row in conn.execute(
            sa.select(table).order_by(*table.primary_key.columns))]
            for name, table in metadata.tables.items()}
    return {
        "runs": runs, "steps": steps, "reflog": store.reflog(),
        "notes": store.notes_on(ids), "blobs": {a: store.read_blob(a) for a in addresses},
        "rows": rows,
    }


def test_binary_ids_migration_keeps_everything_recorded(store_urls):
    recorded = open_store(store_urls())
    _record_everything(recorded)
    url = store_urls()
    copy_as(recorded, url, "0007_step_body_codecs")  # addresses as 64 hex characters
    with create_db_engine(url).connect() as conn:
        head = conn.execute(sa.text("SELECT head FROM refs WHERE name = 'main'")).scalar_one()
    assert head == recorded.resolve("main")  # text, as 0007 kept it
    store = open_store(url)  # migrates 0007 -> 0008
    try:
        assert store.fsck().problems == []
        assert _everything(store) == _everything(recorded)
        with store.engine.connect() as conn:
            kept = conn.execute(sa.text("SELECT head FROM refs WHERE name = 'main'")).scalar_one()
            assert bytes(kept) == bytes.fromhex(head)  # its 32 raw bytes
            ids = conn.execute(sa.text("SELECT id, parent_id, skip_id FROM steps")).all()
        assert {len(value) for row in ids for value in row if value is not None} == {32}
        # The tables still refuse changes, and a new step goes on from where the run was.
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM notes"))
        assert store.run("main").record_note("after").parent_id == recorded.resolve("main")
        assert store.fsck().problems == []
    finally:
        store.close()
        recorded.close()


def test_binary_ids_migration_refuses_an_address_that_is_not_hex(store_urls):
    from kvtrace.errors import StoreError

    recorded = open_store(store_urls())
    recorded.run("main").record_tool_call("t", {}, 1)
    url = store_urls()
    copy_as(recorded, url, "0007_step_body_codecs")
    recorded.close()
    engine = create_db_engine(url)
    with engine.begin() as conn:  # behind kvtrace's back: refs is the one mutable table
        conn.execute(sa.text("UPDATE refs SET head = 'NOT-HEX' WHERE name = 'main'"))
    engine.dispose()
    with pytest.raises(StoreError, match=r"refs\.head holds 'NOT-HEX'"):
        open_store(url)
    engine = create_db_engine(url)
    with engine.connect() as conn:  # nothing was changed: the store is still at 0007
        assert MigrationContext.configure(conn).get_current_revision() == "0007_step_body_codecs"
        assert conn.execute(sa.text("SELECT head FROM refs")).scalar_one() == "NOT-HEX"
    engine.dispose()


def test_binary_ids_migration_goes_back_to_hex(store_urls):
    recorded = open_store(store_urls())
    _record_everything(recorded)
    url = store_urls()
    copy_as(recorded, url, "0007_step_body_codecs")
    engine = create_db_engine(url)
    with engine.connect() as conn:
        before = {name: conn.execute(sa.text(f"SELECT * FROM {name} ORDER BY 1")).all()
                  for name in metadata.tables}
    with engine.begin() as conn:
        _upgrade(conn, "0008_binary_ids")
    with engine.begin() as conn:
        _downgrade(conn, "0007_step_body_codecs")
    with engine.connect() as conn:
        after = {name: conn.execute(sa.text(f"SELECT * FROM {name} ORDER BY 1")).all()
                 for name in metadata.tables}
    engine.dispose()
    recorded.close()
    assert after == before


# -- 0009_blob_deltas: deltas of quoted tool results; PostgreSQL's parent index as a hash -

def _parent_index(conn: sa.Connection) -> str:
    if conn.dialect.name == "postgresql":
        return str(conn.execute(sa.text(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_steps_parent_id' "
            "AND schemaname = current_schema()")).scalar_one())
    return str(conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE "
                                    "name = 'ix_steps_parent_id'")).scalar_one())


def _blob_key(conn: sa.Connection) -> tuple[str, str]:
    """PostgreSQL: the constraint that keeps blob addresses unique, and its type."""
    row = conn.execute(sa.text(
        "SELECT conname, contype FROM pg_constraint WHERE conrelid = 'blobs'::regclass "
        "AND contype IN ('p', 'x')")).one()
    return str(row[0]), str(row[1])


def test_blob_deltas_migration_keeps_everything_and_hashes_the_parent_index(store_urls):
    recorded = open_store(store_urls())
    _record_everything(recorded)
    result = " ".join(hashlib.sha256(bytes([i])).hexdigest() for i in range(20))  # no repeats
    recorded.run("main").record_tool_call("read", {}, result, call_id="c1")
    recorded.run("main").record_model_call(
        [{"role": "tool", "tool_call_id": "c1", "content": result}], "ok", model="m")
    url = store_urls()
    copy_as(recorded, url, "0008_binary_ids")  # every blob whole, a B-tree parent index
    engine = create_db_engine(url)
    with engine.connect() as conn:
        assert "hash" not in _parent_index(conn).lower()
    engine.dispose()
    store = open_store(url)  # migrates 0008 -> 0009
    try:
        assert store.fsck().problems == []
        mine, theirs = _everything(store), _everything(recorded)
        assert mine.pop("rows").pop("blobs") != theirs.pop("rows").pop("blobs")  # kept apart
        assert mine == theirs
        with store.engine.connect() as conn:
            index = _parent_index(conn)
            assert ("USING hash" in index) == (conn.dialect.name == "postgresql"), index
            if conn.dialect.name == "postgresql":  # blob addresses: a hash exclusion, no key
                assert _blob_key(conn) == ("blobs_hash_once", "x")
        # Addresses stay unique: the same content again adds no row.
        recorded_blobs = len(_everything(store)["rows"]["blobs"])
        store.run("again").record_tool_call("read", {}, result, call_id="c1")
        assert len(_everything(store)["rows"]["blobs"]) == recorded_blobs
        # The forks of a run are found through it as before.
        assert store.forks("main") == recorded.forks("main") != []
        with engine.begin() as conn:
            _downgrade(conn, "0008_binary_ids")
            assert "hash" not in _parent_index(conn).lower()
            if conn.dialect.name == "postgresql":
                assert _blob_key(conn) == ("blobs_pkey", "p")
    finally:
        store.close()
        recorded.close()
        engine.dispose()
