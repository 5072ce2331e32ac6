"""The physical anchor of an append: the same rows, written with plain `sqlite3`.

What recording a step costs the database itself. The anchor is a second
SQLite file with the store's own schema (its tables, indexes and triggers,
copied from the store's file) and the same settings (WAL, the store's
`synchronous`). For each step the store recorded, the anchor reads its rows
back from the store (untimed) and writes them with the `sqlite3` module alone
in one transaction, as `Store.append` writes them: BEGIN IMMEDIATE, the
step's blobs as the store keeps them (INSERT ... ON CONFLICT DO NOTHING), its step row, the ref's
compare-and-swap, its reflog row, COMMIT. What `Store.append` costs above
that (encoding, hashing, the pause check, SQLAlchemy) is the store's
overhead; `bench store` reports the ratio of the two medians. Rows are
copied as the store keeps them (addresses as their raw bytes), so the anchor
writes the very bytes the store wrote.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from kvtrace.store.objects import bodies

_STEP_COLUMNS = ("id", "parent_id", "kind", "depth", "body", "recorded_at", "skip_id", "skip_depth",
                 "body_codec")
_REFLOG_COLUMNS = ("ref", "old_head", "new_head", "reason", "message", "created_at")


class SqliteAnchor:
    """A plain-`sqlite3` copy of one run of a SQLite store, appended to step by step."""

    def __init__(self, store_path: Path, path: Path, run: str, *, synchronous: int) -> None:
        """`synchronous`: the store's setting (a per-connection PRAGMA, not in the file)."""
        self._source = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
        # The store's own schema: tables first, then their indexes and triggers.
        schema = [sql for (sql,) in self._source.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'alembic%' "
            "ORDER BY type != 'table', rowid")]
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={int(synchronous)}")
        for sql in schema:
            self._conn.execute(sql)
        self._run = run
        # Every column the store keeps for a blob (its codec too, once it has one).
        self._blob_columns = [r[1] for r in self._source.execute("PRAGMA table_info(blobs)")]
        self._head: str | None = None
        self._reflog_seen = 0  # the store's reflog ids read so far
        self._conn.execute(
            "INSERT INTO refs (name, head, created_at) VALUES (?, NULL, ?)", (run, time.time()))

    def append(self, step_ids: list[str]) -> list[float]:
        """Write these steps of the store (a chain, root-most first); ms per step."""
        reflog_rows = {}
        for entry_id, *row in self._source.execute(
            f"SELECT id, {', '.join(_REFLOG_COLUMNS)} FROM reflog WHERE ref = ? AND id > ? "
            "AND reason = 'append' ORDER BY id", (self._run, self._reflog_seen)):
            reflog_rows[bytes(row[2]).hex()] = tuple(row)
            self._reflog_seen = entry_id
        writes = [(*self._rows(step_id), reflog_rows[step_id]) for step_id in step_ids]
        times = []
        for blob_rows, step_row, reflog_row in writes:
            start = time.perf_counter()
            self._write(blob_rows, step_row, reflog_row)
            times.append((time.perf_counter() - start) * 1000)
        return times

    def close(self) -> None:
        self._conn.close()
        self._source.close()

    def _rows(self, step_id: str) -> tuple[list[tuple], tuple]:
        columns = ", ".join(_STEP_COLUMNS)
        step_row = self._source.execute(
            f"SELECT {columns} FROM steps WHERE id = ?", (bytes.fromhex(step_id),)).fetchone()
        body = json.loads(bodies.decode(step_row[4], step_row[8]))
        addresses = set(body["payload"].values())
        for entry in body.get("lists", {}).values():
            addresses.update(entry["items"])
        blob_rows = sorted(self._source.execute(
            f"SELECT {', '.join(self._blob_columns)} FROM blobs "
            f"WHERE hash IN ({', '.join('?' * len(addresses))})",
            [bytes.fromhex(address) for address in sorted(addresses)]).fetchall())
        return blob_rows, step_row

    def _write(self, blob_rows: list[tuple], step_row: tuple, reflog_row: tuple) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            f"INSERT INTO blobs ({', '.join(self._blob_columns)}) VALUES "
            f"({', '.join('?' * len(self._blob_columns))}) ON CONFLICT (hash) DO NOTHING",
            blob_rows)
        conn.execute(
            f"INSERT INTO steps ({', '.join(_STEP_COLUMNS)}) VALUES "
            f"({', '.join('?' * len(_STEP_COLUMNS))}) ON CONFLICT (id) DO NOTHING", step_row)
        swapped = conn.execute(
            "UPDATE refs SET head = ? WHERE name = ? AND head IS ?",
            (step_row[0], self._run, self._head)).rowcount
        if swapped != 1:
            conn.execute("ROLLBACK")
            raise RuntimeError("the anchor's ref moved: it is written by one writer only")
        conn.execute(
            f"INSERT INTO reflog ({', '.join(_REFLOG_COLUMNS)}) VALUES "
            f"({', '.join('?' * len(_REFLOG_COLUMNS))})", reflog_row)
        conn.execute("COMMIT")
        self._head = step_row[0]
