"""Blobs may be kept compressed: `blobs.codec`.

Revision ID: 0005_blob_codecs
Revises: 0004_pause_index

A NULL codec means `data` is the content itself, as every blob written
before this revision is; `zstd` means a zstd frame of it (see
kvtrace/store/objects/codec.py). Addresses still hash the content, so no id
changes and nothing is rewritten. A kvtrace older than this revision refuses
the store (an unknown revision) instead of reading a compressed blob as
content.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_blob_codecs"
down_revision = "0004_pause_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("blobs", sa.Column("codec", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.drop_column("codec")
