"""Tables of the trace store (SQLAlchemy Core).

Only `refs` is mutable, and only its `head` column, through compare-and-swap.
Everything else is append-only, enforced by database triggers created in the
migrations (see migrations/versions). Times are UNIX seconds (float).

Every SHA-256 address (a blob's hash, a step's id, parent and skip pointer, a
ref's head, a reflog entry's heads, a note's step) is kept as its 32 raw
bytes (`Address`: BLOB on SQLite, bytea on PostgreSQL; migration
0008_binary_ids), and given and read as 64 lowercase hex characters: nothing
above the columns sees bytes. SQLAlchemy converts at each statement it runs;
the statements that go to the driver directly (`backend.Prepared`, the
PostgreSQL `unnest` inserts) convert through the same type.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)

# The revision the code expects; a test checks it is the migrations' head.
SCHEMA_REVISION = "0009_blob_deltas"
APPEND_ONLY_TABLES = ("blobs", "steps", "reflog", "notes")
PAUSE_REASONS = ("pause", "resume")  # the reflog entries that decide whether a run is paused
# The condition of the partial index on those entries, as SQL: a query uses the
# index on SQLite only if its WHERE repeats this term exactly (literals, not parameters).
PAUSE_CONDITION = "reason IN ('pause', 'resume')"


class Address(TypeDecorator[str]):
    """A SHA-256 address kept as its 32 raw bytes, given and read as lowercase hex.

    A bound value must be lowercase hex (a ValueError otherwise: no address
    has other characters; readers that take addresses from outside skip
    those that are not, `is_address_text`). A stored value that is not
    bytes can only have been written behind kvtrace's back (SQLite keeps any
    type in any column): it is read as it is, so that fsck reports it
    instead of failing on it.
    """

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: sa.Dialect) -> bytes | None:
        return raw_or_none(value)

    def process_result_value(self, value: object, dialect: sa.Dialect) -> str | None:
        if value is None:
            return None
        if isinstance(value, (bytes, memoryview)):
            return value.hex()
        return str(value)


def is_address_text(value: object) -> bool:
    """Whether `value` spells bytes in lowercase hex, as every address is written."""
    try:
        to_raw(value)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def raw_or_none(address: str | None) -> bytes | None:
    """`to_raw` of an address, None of None: what an `Address` column is given."""
    return None if address is None else to_raw(address)


def to_raw(address: str) -> bytes:
    """The bytes a hex address is kept as; ValueError when it is not lowercase hex.

    `bytes.fromhex` alone would take capitals and spaces: spelling the bytes
    again must give the address back. (That check costs a fifth of a regex's,
    ~0.2 µs: every append converts about ten addresses.)
    """
    try:
        raw = bytes.fromhex(address)
    except (TypeError, ValueError):
        raw = None
    if raw is None or raw.hex() != address:
        raise ValueError(f"not an address in lowercase hex: {str(address)[:80]!r}")
    return raw


metadata = MetaData()

blobs = Table(
    "blobs",
    metadata,
    # The key on SQLite; on PostgreSQL an exclusion constraint over a hash index keeps each
    # address once instead (migration 0009: about 60 % of a B-tree's bytes).
    Column("hash", Address, primary_key=True),
    Column("size", Integer, nullable=False),  # of the content, however it is kept
    Column("data", LargeBinary, nullable=False),
    Column("codec", String(16), nullable=True),  # how `data` keeps the content: see codec.py
)

steps = Table(
    "steps",
    metadata,
    Column("id", Address, primary_key=True),
    Column("parent_id", Address, nullable=True),
    Column("kind", String(64), nullable=False),
    Column("depth", Integer, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("recorded_at", Float, nullable=False),
    Column("skip_id", Address, nullable=True),  # see history.py
    Column("skip_depth", Integer, nullable=True),
    Column("body_codec", String(16), nullable=True),  # how `body` keeps it: see bodies.py
    # A hash index on PostgreSQL: equality only, half a B-tree's size (migration 0009).
    Index("ix_steps_parent_id", "parent_id", postgresql_using="hash",
          postgresql_with={"fillfactor": 90}),
)

refs = Table(
    "refs",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("head", Address, nullable=True),
    Column("created_at", Float, nullable=False),
    Index("ix_refs_head", "head"),  # the runs at a step (log --graph), see migration 0006
)

reflog = Table(
    "reflog",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ref", String(200), nullable=False),
    Column("old_head", Address, nullable=True),
    Column("new_head", Address, nullable=True),
    Column("reason", String(32), nullable=False),
    Column("message", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_reflog_ref", "ref", "id"),
    # Only pauses and resumes: an append finds whether its run is paused in one probe.
    Index("ix_reflog_pauses", "ref", "id", sqlite_where=sa.text(PAUSE_CONDITION),
          postgresql_where=sa.text(PAUSE_CONDITION)),
)

notes = Table(
    "notes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("step_id", Address, ForeignKey("steps.id"), nullable=False),
    Column("author", String(200), nullable=True),
    Column("text", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_notes_step_id", "step_id"),
)
