"""Blobs kept as zstd deltas, and PostgreSQL's parent index as a hash index.

Revision ID: 0009_blob_deltas
Revises: 0008_binary_ids

From this revision a blob may be kept with codec `zstd-delta` (a tool
result quoted in the next prompt's message is kept as a delta against the
result: kvtrace/store/codec.py, deltas.py). Nothing is rewritten for it;
the revision exists so that an older kvtrace refuses the store (unknown
revision) instead of failing on a codec it does not know at some read.

On PostgreSQL `ix_steps_parent_id` becomes a hash index: its only queries
are equality (`parent_id = X`, `parent_id IN (...)`, a recursive walk down
the children), and on random 32-byte keys a B-tree keeps each entry's whole
key in pages split half full, about 95 bytes a step against about 55. SQLite
has no hash index: its B-tree stays.
"""

from __future__ import annotations

from alembic import op

revision = "0009_blob_deltas"
down_revision = "0008_binary_ids"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_steps_parent_id", table_name="steps")
        op.create_index("ix_steps_parent_id", "steps", ["parent_id"], postgresql_using="hash")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_steps_parent_id", table_name="steps")
        op.create_index("ix_steps_parent_id", "steps", ["parent_id"])
