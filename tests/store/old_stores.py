"""Stores as an older kvtrace left them, for tests of the migrations.

`copy_as(store, url, revision)` builds the schema of `revision` in the empty
database at `url` (its own migrations, up to it) and copies every row of
`store` into it as that revision kept it: addresses as hex text before
0008_binary_ids (raw bytes from it on), bodies as canonical JSON before 0007,
blob content as it is before 0005, and never a delta (0009): those are kept
as plain zstd. Rows go in the order the store holds them, reflog and note ids
kept. The rows are read through the current schema, so the copy holds exactly
what the store holds, in the older shape.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from kvtrace.store.db.backend import _upgrade, create_db_engine
from kvtrace.store.db.schema import Address, metadata, raw_or_none
from kvtrace.store.objects import bodies, codec

TABLES = ("blobs", "steps", "refs", "reflog", "notes")
_ORDER = {"blobs": None, "steps": "depth", "refs": "name", "reflog": "id", "notes": "id"}


def copy_as(store: Any, url: str, revision: str) -> None:
    """Write every row of `store` into the new database at `url`, at schema `revision`."""
    engine = create_db_engine(url)
    try:
        with store.engine.connect() as source, engine.begin() as target:
            _upgrade(target, revision)
            inspector = sa.inspect(target)
            for name in TABLES:
                kept = inspector.get_columns(name)
                columns = {column["name"] for column in kept}
                table = metadata.tables[name]
                # From 0008 on, address columns keep raw bytes (before it, hex text).
                raw = {column["name"] for column in kept
                       if isinstance(table.c[column["name"]].type, Address)
                       and isinstance(column["type"], sa.LargeBinary)}
                query = sa.select(table)
                if _ORDER[name] is not None:
                    query = query.order_by(table.c[_ORDER[name]], *table.primary_key.columns)
                rows = [_as_kept(name, _no_delta(source, name, dict(row._mapping)), columns)
                        for row in source.execute(query)]
                rows = [{key: raw_or_none(value) if key in raw else value
                         for key, value in row.items()} for row in rows]
                if rows:
                    names = sorted(rows[0])
                    target.execute(sa.text(
                        f"INSERT INTO {name} ({', '.join(names)}) "
                        f"VALUES ({', '.join(':' + n for n in names)})"), rows)
                if rows and name in ("reflog", "notes") and target.dialect.name == "postgresql":
                    # The ids were given: the next one the store takes follows them.
                    target.execute(sa.text(
                        f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                        f"(SELECT max(id) FROM {name}))"))
    finally:
        engine.dispose()


def _no_delta(source: sa.Connection, table: str, row: dict[str, Any]) -> dict[str, Any]:
    """`row`, a blob kept as a delta (which no revision before 0009 knows) kept whole."""
    if table != "blobs" or row["codec"] != codec.DELTA:
        return row
    return codec.row(row["hash"], codec.read(source, [row["hash"]])[row["hash"]])


def _as_kept(table: str, row: dict[str, Any], columns: set[str]) -> dict[str, Any]:
    """`row` (read at the current revision: addresses as hex) as a revision whose table has
    `columns` kept it (addresses are converted after it, where the columns keep bytes)."""
    if table == "steps" and "body_codec" not in columns:
        row["body"] = bodies.decode(bytes(row["body"]), row.pop("body_codec"))
    if table == "blobs" and "codec" not in columns:
        row["data"] = codec.decode(codec.Kept(row["size"], row.pop("codec"), bytes(row["data"])))
    unknown = set(row) - columns
    if unknown:
        raise ValueError(f"{table} at this revision has no column for {sorted(unknown)}")
    return row
