"""A partial index on the reflog's pauses and resumes.

Revision ID: 0004_pause_index
Revises: 0003_message_lists

Every append checks that its run is not paused: the newest `pause` or
`resume` entry of the run decides (kvtrace/store/objects/refs.py). Through
`ix_reflog_ref` that query walked back over every entry of the run, so an
append cost grew with the run's length (0.5 ms of a 1.3 ms append at
1,000 steps). This index holds only pause and resume entries, so the check
is one probe. Nothing is rewritten.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_pause_index"
down_revision = "0003_message_lists"
branch_labels = None
depends_on = None

# As in kvtrace/store/db/schema.py (PAUSE_CONDITION), frozen here as this revision wrote it.
_CONDITION = "reason IN ('pause', 'resume')"


def upgrade() -> None:
    op.create_index(
        "ix_reflog_pauses", "reflog", ["ref", "id"],
        sqlite_where=sa.text(_CONDITION), postgresql_where=sa.text(_CONDITION),
    )


def downgrade() -> None:
    op.drop_index("ix_reflog_pauses", table_name="reflog")
