"""Tables of the trace store (SQLAlchemy Core).

Only `refs` is mutable, and only its `head` column, through compare-and-swap.
Everything else is append-only, enforced by database triggers created in the
migrations (see migrations/versions). Times are UNIX seconds (float).
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
)

# The revision the code expects; a test checks it is the migrations' head.
SCHEMA_REVISION = "0007_step_body_codecs"
APPEND_ONLY_TABLES = ("blobs", "steps", "reflog", "notes")
PAUSE_REASONS = ("pause", "resume")  # the reflog entries that decide whether a run is paused
# The condition of the partial index on those entries, as SQL: a query uses the
# index on SQLite only if its WHERE repeats this term exactly (literals, not parameters).
PAUSE_CONDITION = "reason IN ('pause', 'resume')"

metadata = MetaData()

blobs = Table(
    "blobs",
    metadata,
    Column("hash", String(64), primary_key=True),
    Column("size", Integer, nullable=False),  # of the content, however it is kept
    Column("data", LargeBinary, nullable=False),
    Column("codec", String(16), nullable=True),  # how `data` keeps the content: see codec.py
)

steps = Table(
    "steps",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("parent_id", String(64), nullable=True),
    Column("kind", String(64), nullable=False),
    Column("depth", Integer, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("recorded_at", Float, nullable=False),
    Column("skip_id", String(64), nullable=True),  # see history.py
    Column("skip_depth", Integer, nullable=True),
    Column("body_codec", String(16), nullable=True),  # how `body` keeps it: see bodies.py
    Index("ix_steps_parent_id", "parent_id"),
)

refs = Table(
    "refs",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("head", String(64), nullable=True),
    Column("created_at", Float, nullable=False),
    Index("ix_refs_head", "head"),  # the runs at a step (log --graph), see migration 0006
)

reflog = Table(
    "reflog",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ref", String(200), nullable=False),
    Column("old_head", String(64), nullable=True),
    Column("new_head", String(64), nullable=True),
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
    Column("step_id", String(64), ForeignKey("steps.id"), nullable=False),
    Column("author", String(200), nullable=True),
    Column("text", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_notes_step_id", "step_id"),
)
