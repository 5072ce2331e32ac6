"""What the store's files hold: file bytes over the distinct content bytes of an import.

`store_bytes_over_distinct` (kvtrace/bench/store.py) counts blob and step-body
bytes; a user's disk holds more: row headers, indexes, page slack, the WAL.
This imports tau-bench-shaped trajectories (conversations.py: 60 calls each,
each from its own seed, so nothing dedups across them) through the OpenAI
importer, as `kvtrace import --format openai` records them (model calls and
one tool_call step per tool result), into a store, and measures:

- SQLite: the database file plus its WAL after a checkpoint (TRUNCATE), of a
  new file holding only the import (so the empty schema's pages count too);
- PostgreSQL: the growth of `pg_total_relation_size` (table, indexes, TOAST)
  summed over kvtrace's tables.

The denominator is the canonical bytes of the distinct messages and tool
lists imported: what an ideal store would keep. Reading a step back
(`Store.show` of each model call, whose messages resolve through their base
steps) is timed on the same store: what storing more compactly may cost.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store import StepKind, Store, open_store
from kvtrace.store.db.schema import steps
from kvtrace.store.objects import bodies

KVTRACE_TABLES = ("blobs", "steps", "refs", "reflog", "notes", "alembic_version")


def run_footprint_bench(url: str | None = None, *, num_conversations: int = 14) -> dict[str, Any]:
    """File bytes over distinct content bytes of `num_conversations` imported trajectories
    (14: just over 1 MB of distinct content) on `url` (default: a new SQLite file)."""
    from kvtrace.apis.chat import normalize_message
    from kvtrace.bench.conversations import tool_calling_conversation
    from kvtrace.formats import import_document
    from kvtrace.store.objects.encoding import canonical_json

    suffix = time.time_ns()
    distinct: set[bytes] = set()
    with tempfile.TemporaryDirectory(prefix="kvtrace-footprint-") as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'footprint.db'}")
        try:
            before = 0 if url is None else store_file_bytes(store)
            start = time.perf_counter()
            num_steps = 0
            for index in range(num_conversations):
                calls = tool_calling_conversation(60, seed=1000 + index)
                messages = [*calls[-1].messages, calls[-1].response]
                info = import_document(store, {"messages": messages, "tools": calls[0].tools},
                                       format="openai", run=f"footprint-{suffix}-{index}")
                num_steps += info.depth
                distinct.update(canonical_json(normalize_message(m)) for m in messages)
                distinct.add(canonical_json(calls[0].tools))
            import_s = time.perf_counter() - start
            file_bytes = store_file_bytes(store) - before
            read_ms = _read_ms(store, [f"footprint-{suffix}-{i}" for i in range(num_conversations)])
        finally:
            store.close()
    distinct_bytes = sum(len(item) for item in distinct)
    return {
        "num_conversations": num_conversations,
        "num_steps": num_steps,
        "distinct_content_bytes": distinct_bytes,
        "file_bytes": file_bytes,
        "file_bytes_over_distinct": round(file_bytes / distinct_bytes, 3),
        "import_steps_per_s": round(num_steps / import_s, 1),
        "read_step_ms_p50": round(statistics.median(read_ms), 4),
    }


def body_bytes(conn: Connection) -> tuple[int, int]:
    """(canonical, kept): the bytes of every step body as its id hashes it, and as the
    `steps` rows keep it (packed: store/objects/bodies.py). Content figures count the first."""
    canonical = kept = 0
    query = sa.select(steps.c.body, steps.c.body_codec)
    for body, body_codec in conn.execution_options(yield_per=1000).execute(query):
        canonical += len(bodies.decode(body, body_codec))
        kept += len(body)
    return canonical, kept


def store_file_bytes(store: Store) -> int:
    """SQLite: file + WAL after a checkpoint; PostgreSQL: kvtrace's relations, all forks."""
    engine = store.engine
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        path = Path(str(engine.url.database))
        wal = path.with_name(path.name + "-wal")
        return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    with engine.connect() as conn:
        return int(sum(
            conn.execute(sa.text("SELECT pg_total_relation_size(to_regclass(:t))"),
                         {"t": table}).scalar() or 0
            for table in KVTRACE_TABLES))


def _read_ms(store: Store, runs: list[str], per_run: int = 10) -> list[float]:
    """ms to read model calls of `runs` back (`Store.show`), `per_run` of each spread
    over the run, each by a store opened for it (as `kvtrace show` does: nothing cached)."""
    times = []
    for name in runs:
        model_calls = [s.id for s in store.log(name) if s.kind == StepKind.MODEL_CALL]
        for step_id in model_calls[:: max(1, len(model_calls) // per_run)]:
            reader = open_store(store.url)
            try:
                begin = time.perf_counter()
                reader.show(step_id)
                times.append((time.perf_counter() - begin) * 1000)
            finally:
                reader.close()
    return times
