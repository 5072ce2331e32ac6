"""What one run's operations read does not grow with the store (issue 22, `bench scale`).

Each operation on one run (a page of runs, log, log --graph, show, RUN@N, fork, revert,
diff, export, import) runs against a store that holds other runs, with every statement it
sends captured; each query's plan, asked of the database itself, must reach each table
through an index condition: never a scan of every row of a table (a scan along an index
is allowed only under a LIMIT, as a page of `runs` reads it). On PostgreSQL the plans
are asked with sequential scans disabled, so a plan that still scans a whole table has
no index to use. Timing is `kvtrace bench scale`'s job; this pins the cause.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from kvtrace import open_store
from kvtrace.bench.conversations import agent_document
from kvtrace.formats import export_document, import_document
from kvtrace.store import Store
from kvtrace.store.present.compare import compare

TABLES = ("steps", "blobs", "refs", "reflog", "notes")


def _build(store: Store) -> None:
    """Three imported agent runs, one of them forked with an edit and extended."""
    for index, shape in enumerate(("swe", "tau", "swe")):
        import_document(store, agent_document(6, seed=index, shape=shape), format="openai",
                        run=f"run-{index}")
    tool = next(s for s in store.log("run-0") if s.kind == "tool_call" and s.depth > 3)
    fork = store.fork(tool.id, "run-0-edited", edit={"result": "<returncode>1</returncode>"})
    fork.record_tool_call("bash", {"command": "true"}, "ok")
    store.note("run-0@2", "looked at")


OPERATIONS: dict[str, Callable[[Store], Any]] = {
    "runs page": lambda s: s.runs(limit=2, after="run-0"),
    "run_info": lambda s: s.run_info("run-0"),
    "log page": lambda s: list(s.log("run-0", limit=3)),
    "log --graph page": lambda s: s.graph("run-0", limit=5),
    "show RUN@N": lambda s: s.show("run-0@4"),
    "resolve RUN@2": lambda s: s.resolve("run-0@2"),
    "fork": lambda s: s.fork("run-0@2", "forked"),
    "revert": lambda s: s.revert("run-0", to="run-0@2"),
    "reset": lambda s: s.reset("run-0", to="run-0-edited"),
    "last move": lambda s: s.reflog("run-0", limit=1),
    "diff": lambda s: compare(s, "run-0", "run-0-edited"),
    "export bundle": lambda s: s.export_run("run-0", io.BytesIO()),
    "export openai": lambda s: export_document(s, "run-0", format="openai"),
    "export otel": lambda s: export_document(s, "run-0", format="otel"),
    "import": lambda s: import_document(s, agent_document(4, seed=9), format="openai",
                                        run="imported"),
}


@contextmanager
def _captured(store: Store) -> Iterator[list[tuple[str, Any]]]:
    """(statement, parameters) of every query the store sends meanwhile.

    SQLite: the driver's trace callback (every statement, values inlined);
    PostgreSQL: SQLAlchemy's cursor events (the append path's prepared
    statements, primary-key writes, run under the driver and are not seen).
    """
    found: list[tuple[str, Any]] = []
    engine = store.engine
    if engine.dialect.name == "sqlite":
        def on_connect(dbapi: Any, _record: Any) -> None:
            dbapi.set_trace_callback(lambda sql: found.append((sql, None)))

        sa.event.listen(engine, "connect", on_connect)
        engine.dispose()
        yield found
        return

    def before(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any,
               executemany: bool) -> None:
        if not executemany:
            found.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", before)
    yield found
    sa.event.remove(engine, "before_cursor_execute", before)


def _full_scans(store: Store, statement: str, parameters: Any) -> list[str]:
    """The tables the plan of `statement` reads whole (not under a LIMIT)."""
    words = statement.lstrip().split(None, 1)
    if not words or words[0].upper() not in ("SELECT", "WITH"):
        return []
    with store.engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            plan = [row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}")]
            is_limited = " LIMIT " in statement.upper()
            return [line for line in plan if line.split(" ")[0] == "SCAN"
                    and line.split(" ")[1] in TABLES
                    and not (is_limited and " USING " in line)]
        import psycopg

        dbapi = conn.connection.dbapi_connection
        literal = psycopg.ClientCursor(dbapi).mogrify(statement, parameters)
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        (plan,) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {literal}").scalar_one()
        return list(_pg_full_scans(plan["Plan"] if isinstance(plan, dict) else
                                   json.loads(plan)[0]["Plan"], is_limited=False))


def _pg_full_scans(node: dict[str, Any], *, is_limited: bool) -> Iterator[str]:
    is_limited = is_limited or node["Node Type"] == "Limit"
    table = node.get("Relation Name")
    if table in TABLES:
        if node["Node Type"] == "Seq Scan":
            yield f"Seq Scan on {table}"
        elif "Index" in node["Node Type"] and "Index Cond" not in node and not is_limited:
            yield f"{node['Node Type']} on {table} without a condition"
    for child in node.get("Plans", []):
        yield from _pg_full_scans(child, is_limited=is_limited)


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_single_run_operation_reads_every_table_through_an_index(store_url, name):
    with _built_store(store_url) as store:
        with _captured(store) as captured:
            OPERATIONS[name](store)
            statements = list(captured)  # what the plans are asked with is not the operation's
        assert statements, "no statement was captured"
        scans = {statement[:120]: found for statement, parameters in statements
                 if (found := _full_scans(store, statement, parameters))}
        assert scans == {}


@contextmanager
def _built_store(store_url: str) -> Iterator[Store]:
    """The store the tests build, opened anew (no cache of the build's left)."""
    builder = open_store(store_url)
    _build(builder)
    builder.close()
    store = open_store(store_url)
    try:
        yield store
    finally:
        store.close()


def test_fsck_reads_steps_and_blobs_whole_once_each(store_url):
    """fsck streams each table once. The steps and blobs a row refers to (a parent, a
    blob, a ref's head, a note's step) it reaches through their primary keys: those two
    tables, which grow with the store, are never read whole but by their own stream."""
    with _built_store(store_url) as store:
        with _captured(store) as captured:
            assert store.fsck().is_ok
            statements = list(captured)
        read_whole: list[tuple[str, str]] = []  # (the table a statement streams, one read whole)
        for statement, parameters in statements:
            words = statement.split()  # "SELECT steps.id, ...": it streams steps
            streamed = words[1].split(".")[0] if len(words) > 1 else ""
            for scan in _full_scans(store, statement, parameters):
                table = scan.split(" on ")[1].split()[0] if " on " in scan else scan.split()[1]
                if table in ("steps", "blobs"):
                    read_whole.append((streamed, table))
        assert sorted(read_whole) == [("blobs", "blobs"), ("steps", "steps")]
