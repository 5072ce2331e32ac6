"""The append path: one write transaction of prebuilt statements, a pause check that
costs one index probe, and what the driver-level statements (backend.Prepared) promise."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from kvtrace.errors import ConflictError, RunPausedError, StoreError
from kvtrace.store.db.backend import Prepared, write_transaction, writer
from kvtrace.store.db.schema import notes
from kvtrace.store.objects.refs import _PAUSE


def test_an_append_on_sqlite_is_one_write_transaction_of_five_statements(tmp_path):
    from kvtrace import open_store

    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    statements: list[str] = []
    event.listen(store.engine, "checkout",  # before the first write checks a connection out
                 lambda dbapi, record, proxy: dbapi.set_trace_callback(statements.append))
    run = store.run("r")
    run.record_tool_call("t", {"i": 0}, 0)
    statements.clear()
    run.record_tool_call("t", {"i": 1}, 1)
    assert [s for s in statements if s.startswith(("BEGIN", "COMMIT"))] == [
        "BEGIN IMMEDIATE", "COMMIT"]
    # One line per row written and per trigger fired: one per statement once repeats go.
    verbs = [f"{s.split()[0]} {s.split()[2]}" for s in statements[1:-1]]
    assert [v for i, v in enumerate(verbs) if i == 0 or verbs[i - 1] != v] == [
        "INSERT blobs", "INSERT steps", "UPDATE SET", "SELECT message", "INSERT reflog"]
    store.close()


def test_the_pause_check_probes_the_partial_index_of_pauses(store):
    store.run("r").record_tool_call("t", {}, 1)
    sql = _PAUSE._sql(store.engine.dialect).sql
    with store.engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            plan = " ".join(str(row[-1]) for row in conn.exec_driver_sql(
                f"EXPLAIN QUERY PLAN {sql}", ("r",)))
        else:  # a tiny table is scanned unless told otherwise; the index must be usable
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            plan = " ".join(str(row[0]) for row in conn.exec_driver_sql(
                f"EXPLAIN {sql}", {"ref_name": "r"}))
    assert "ix_reflog_pauses" in plan


def test_threads_sharing_one_store_append_without_losing_a_step(store):
    runs = [store.run(f"w{i}") for i in range(4)]
    errors: list[BaseException] = []

    def append(run):
        try:
            for i in range(25):
                run.record_tool_call("t", {"i": i}, i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [info.depth for info in store.runs()] == [25, 25, 25, 25]
    assert store.fsck().problems == []


def test_threads_sharing_one_store_and_one_head_get_one_winner(store):
    store.run("race").record_tool_call("t", {}, 0)
    runs = [store.run("race") for _ in range(4)]  # every writer saw the same head
    outcomes: list[object] = []
    barrier = threading.Barrier(4)

    def append(index):
        barrier.wait()
        try:
            outcomes.append(runs[index].record_tool_call("t", {"who": index}, index))
        except ConflictError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(o, ConflictError) for o in outcomes) == 3
    assert store.head("race").depth == 2


def test_a_pause_from_another_store_stops_the_next_append(store_url):
    from kvtrace import open_store

    writer_store, supervisor = open_store(store_url), open_store(store_url)
    run = writer_store.run("w")
    run.record_tool_call("t", {}, 1)  # the writer's connection is now held (SQLite)
    supervisor.pause("w", reason="look")
    with pytest.raises(RunPausedError):
        run.record_tool_call("t", {}, 2)
    supervisor.resume("w")
    assert run.record_tool_call("t", {}, 2).depth == 2
    writer_store.close()
    supervisor.close()


def test_a_driver_error_in_a_prepared_statement_is_a_store_error(store):
    insert = Prepared(sa.insert(notes).values(
        step_id=sa.bindparam("step_id"), author=sa.bindparam("author"),
        text=sa.bindparam("text"), created_at=sa.bindparam("created_at")))
    with pytest.raises(StoreError, match="database write failed"), \
            write_transaction(writer(store.engine)) as conn:
        # No such step: the foreign key refuses it.
        insert.execute(conn, {"step_id": "0" * 64, "author": None, "text": "x",
                              "created_at": 0.0})
    assert store.fsck().num_notes == 0


def test_a_prepared_statement_refuses_a_value_it_would_drop(store):
    fixed = Prepared(sa.select(notes.c.id).where(notes.c.text == "built in"))
    with pytest.raises(StoreError, match="every parameter by name"), \
            write_transaction(writer(store.engine)) as conn:
        fixed.first(conn, {})
