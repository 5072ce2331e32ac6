"""Blobs kept as zstd deltas; on PostgreSQL, hash indexes for blob addresses and parents.

Revision ID: 0009_blob_deltas
Revises: 0008_binary_ids

From this revision a blob may be kept with codec `zstd-delta` (a tool
result quoted in the next prompt's message is kept as a delta against the
result: kvtrace/store/objects/codec.py, deltas.py). Nothing is rewritten for it;
the revision exists so that an older kvtrace refuses the store (unknown
revision) instead of failing on a codec it does not know at some read.

On PostgreSQL two B-trees over random 32-byte keys become hash indexes,
which keep a 4-byte hash code per entry instead of the key, in pages that
are not split half full, filled to 90 % (about 40 bytes an entry against 88-95):

- `ix_steps_parent_id`: its only queries are equality (`parent_id = X`,
  `parent_id IN (...)`, a recursive walk down the children);
- `blobs`' primary key becomes an exclusion constraint over a hash index
  (`EXCLUDE USING hash (hash WITH =)`): blobs are only ever found by their
  whole address, and the constraint keeps each address once, as the key did
  (an insert of an address that is there is skipped, `ON CONFLICT DO
  NOTHING`; a concurrent one waits for the first to commit, then is
  skipped). No foreign key points at a blob, so none needs the key. `steps`
  keeps its primary key: the notes' foreign key needs one.

SQLite has no hash index: its B-trees stay.
"""

from __future__ import annotations

from alembic import op

revision = "0009_blob_deltas"
down_revision = "0008_binary_ids"
branch_labels = None
depends_on = None

BLOB_ADDRESSES = "blobs_hash_once"  # PostgreSQL: the exclusion constraint that replaces the key
# How full a hash bucket page gets before the index splits a bucket (PostgreSQL's default
# 75): at 90 the footprint import's indexes take 35 % fewer bytes, and a probe still reads
# one page in most buckets (an address is only ever looked up whole).
HASH_FILLFACTOR = 90


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_steps_parent_id", table_name="steps")
        op.create_index("ix_steps_parent_id", "steps", ["parent_id"], postgresql_using="hash",
                        postgresql_with={"fillfactor": HASH_FILLFACTOR})
        op.drop_constraint("blobs_pkey", "blobs", type_="primary")
        op.execute(f"ALTER TABLE blobs ADD CONSTRAINT {BLOB_ADDRESSES} "
                   f"EXCLUDE USING hash (hash WITH =) WITH (fillfactor = {HASH_FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_steps_parent_id", table_name="steps")
        op.create_index("ix_steps_parent_id", "steps", ["parent_id"])
        op.drop_constraint(BLOB_ADDRESSES, "blobs")
        op.create_primary_key("blobs_pkey", "blobs", ["hash"])
