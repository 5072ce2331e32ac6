"""Addresses kept as 32 raw bytes instead of 64 hex characters.

Revision ID: 0008_binary_ids
Revises: 0007_step_body_codecs

`blobs.hash`, `steps.id`, `steps.parent_id`, `steps.skip_id`, `refs.head`,
`reflog.old_head`, `reflog.new_head` and `notes.step_id` become BLOB (SQLite)
or bytea (PostgreSQL), each value the bytes its hex spelled: half the bytes
in every row and index that holds an address. The code reads and writes hex
as before (kvtrace/store/db/schema.py `Address`); no id, body or content
changes.

PostgreSQL converts each column in place (`ALTER COLUMN ... TYPE bytea USING
decode(..., 'hex')`), which rewrites the tables and their indexes; the
foreign key of `notes.step_id` is dropped around it (both ends change type)
and the append-only triggers, which fire on rows, not on ALTER, stay.
SQLite cannot change a column's type: each table is rebuilt. Its triggers
are dropped, the old table renamed aside (SQLite points the notes' foreign
key at the renamed steps, so no check fails), a new table created under the
old name, the rows copied in their order a page at a time, converted in
Python (SQLite 3.40 has no `unhex`), the old table dropped, then the indexes
and triggers created again. All of it in the migration's one transaction:
a store is migrated whole or not at all.

An address that is not lowercase hex (only SQL behind kvtrace's back can
write one) stops the migration with its table and column named: converting
it would change it, and nothing recorded is ever changed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008_binary_ids"
down_revision = "0007_step_body_codecs"
branch_labels = None
depends_on = None

ADDRESSES = {
    "blobs": ("hash",),
    "steps": ("id", "parent_id", "skip_id"),
    "refs": ("head",),
    "reflog": ("old_head", "new_head"),
    "notes": ("step_id",),
}
# Parents before children: a note's step is copied before the note.
_ORDER = ("blobs", "steps", "refs", "reflog", "notes")
_APPEND_ONLY_KEYS = {"blobs": "hash", "steps": "id", "reflog": "id", "notes": "id"}
_PAGE = 1000  # rows copied per statement on SQLite
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_PAUSE_CONDITION = "reason IN ('pause', 'resume')"  # as 0004 wrote it


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _convert_postgresql("bytea", "decode({column}, 'hex')")
    else:
        _rebuild_sqlite(sa.LargeBinary(), _to_raw)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _convert_postgresql("varchar(64)", "encode({column}, 'hex')")
    else:
        _rebuild_sqlite(sa.String(64), _to_hex)


def _convert_postgresql(new_type: str, using: str) -> None:
    bind = op.get_bind()
    if new_type == "bytea":
        for table, columns in ADDRESSES.items():
            for column in columns:
                bad = bind.execute(sa.text(
                    f"SELECT {column} FROM {table} WHERE {column} !~ '^([0-9a-f]{{2}})*$' LIMIT 1"
                )).first()
                if bad is not None:
                    raise ValueError(_not_hex(table, column, bad[0]))
    op.execute("ALTER TABLE notes DROP CONSTRAINT notes_step_id_fkey")
    for table, columns in ADDRESSES.items():
        changes = ", ".join(
            f"ALTER COLUMN {column} TYPE {new_type} USING {using.format(column=column)}"
            for column in columns)
        op.execute(f"ALTER TABLE {table} {changes}")
    op.execute("ALTER TABLE notes ADD CONSTRAINT notes_step_id_fkey "
               "FOREIGN KEY (step_id) REFERENCES steps (id)")


def _rebuild_sqlite(address: sa.types.TypeEngine[Any],
                    convert: Callable[[str, str, Any], Any]) -> None:
    bind = op.get_bind()
    new = _tables(address)
    triggers = bind.execute(sa.text(
        "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN "
        "('blobs', 'steps', 'refs', 'reflog', 'notes')")).scalars().all()
    for trigger in triggers:
        op.execute(f"DROP TRIGGER {trigger}")
    for name in _ORDER:
        op.execute(f"ALTER TABLE {name} RENAME TO {name}_old")
    for name in _ORDER:
        table = new.tables[name]
        bind.execute(sa.schema.CreateTable(table))
        _copy_rows(bind, table, convert)
    for name in reversed(_ORDER):  # children first: the notes' key points at steps_old
        op.execute(f"DROP TABLE {name}_old")
    for table in new.sorted_tables:
        for index in sorted(table.indexes, key=lambda index: str(index.name)):
            index.create(bind)
    _create_sqlite_triggers()


def _copy_rows(bind: sa.Connection, table: sa.Table,
               convert: Callable[[str, str, Any], Any]) -> None:
    """Copy `table`'s rows from its old table, in their order, converting its addresses."""
    columns = [column.name for column in table.columns]
    addresses = ADDRESSES[table.name]
    select = sa.text(
        f"SELECT rowid, {', '.join(columns)} FROM {table.name}_old WHERE rowid > :after "
        f"ORDER BY rowid LIMIT {_PAGE}")
    after = -(2**63)
    while rows := bind.execute(select, {"after": after}).all():
        after = rows[-1][0]
        copied = []
        for row in rows:
            values = dict(zip(columns, row[1:], strict=True))
            for column in addresses:
                values[column] = convert(table.name, column, values[column])
            copied.append(values)
        bind.execute(table.insert(), copied)


def _to_raw(table: str, column: str, value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise ValueError(_not_hex(table, column, value))
    return bytes.fromhex(value)


def _to_hex(table: str, column: str, value: Any) -> str | None:
    return None if value is None else bytes(value).hex()


def _not_hex(table: str, column: str, value: Any) -> str:
    return (f"{table}.{column} holds {value!r}, not a lowercase hex address: the store was "
            "changed behind kvtrace's back; repair that row, then open the store again")


def _tables(address: sa.types.TypeEngine[Any]) -> sa.MetaData:
    """The five tables as 0007 left them, with `address` as the type of every address."""
    metadata = sa.MetaData()
    sa.Table(
        "blobs", metadata,
        sa.Column("hash", address, primary_key=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("codec", sa.String(16), nullable=True),
    )
    sa.Table(
        "steps", metadata,
        sa.Column("id", address, primary_key=True),
        sa.Column("parent_id", address, nullable=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("skip_id", address, nullable=True),
        sa.Column("skip_depth", sa.Integer, nullable=True),
        sa.Column("body_codec", sa.String(16), nullable=True),
        sa.Index("ix_steps_parent_id", "parent_id"),
    )
    sa.Table(
        "refs", metadata,
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("head", address, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Index("ix_refs_head", "head"),
    )
    sa.Table(
        "reflog", metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ref", sa.String(200), nullable=False),
        sa.Column("old_head", address, nullable=True),
        sa.Column("new_head", address, nullable=True),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Index("ix_reflog_ref", "ref", "id"),
        sa.Index("ix_reflog_pauses", "ref", "id", sqlite_where=sa.text(_PAUSE_CONDITION)),
    )
    sa.Table(
        "notes", metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("step_id", address, sa.ForeignKey("steps.id"), nullable=False),
        sa.Column("author", sa.String(200), nullable=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Index("ix_notes_step_id", "step_id"),
    )
    return metadata


def _create_sqlite_triggers() -> None:
    """The append-only triggers, as 0001 and 0002 created them."""
    for table, key in _APPEND_ONLY_KEYS.items():
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, 'kvtrace: {action} on {table} rejected: "
                "the trace store is append-only'); END"
            )
        op.execute(
            f"CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table} "
            f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {key} = NEW.{key}) "
            "BEGIN SELECT RAISE(IGNORE); END"
        )
