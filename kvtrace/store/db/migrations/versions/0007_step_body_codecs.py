"""Step bodies may be kept packed: `steps.body_codec`.

Revision ID: 0007_step_body_codecs
Revises: 0006_refs_head_index

A NULL codec means `body` is the canonical body itself, as every step
written before this revision is; `packed1` means its addresses packed as
raw bytes and the whole a zstd frame (see kvtrace/store/objects/bodies.py). Ids
still hash the canonical body, so no id changes and nothing is rewritten:
steps recorded before stay as they are. A kvtrace older than this revision
refuses the store (an unknown revision) instead of reading a packed body as
JSON.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_step_body_codecs"
down_revision = "0006_refs_head_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("body_codec", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("body_codec")
